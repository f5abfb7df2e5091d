from kvbench.cli import main

main(prog_name="kvbench")
