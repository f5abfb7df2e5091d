"""Role presets: prompt-specialized agents in the spirit of KVComm's agent sets.

Each role has its own system prompt and its own glue text (the agent-specific PF segments of
the paper's Eq. 1); the user query and other agents' outputs are the shared PH segments.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    name: str
    system: str
    task_intro: str  # PF glue before the shared query
    peer_intro: str  # PF glue before the first peer output
    peer_glue: str  # PF glue before each peer output; {agent} and {role} are filled in
    answer_prefix: str  # PF glue at the end of the prompt


_MATH_GLUE = dict(
    task_intro="\n\nQ: ",
    peer_intro="\n\nAt the same time, there are the following responses to the same question for your reference:",
    peer_glue="\n\nAgent {agent} as a {role} his answer to this question is:\n\n",
    answer_prefix="\n\nA: ",
)
_ANALYZE_GLUE = dict(
    task_intro="\n\nThe task is: ",
    peer_intro="\n\nAt the same time, the outputs of other agents are as follows:",
    peer_glue="\n\nAgent {agent}, role is {role}, output is:\n\n",
    answer_prefix="\n\nYour answer: ",
)
_CODE_GLUE = dict(
    task_intro="\n\nThe task is:\n\n",
    peer_intro="\n\nAt the same time, the outputs and feedbacks of other agents are as follows:",
    peer_glue="\n\nAgent {agent} as a {role} provides the following info:\n\n",
    answer_prefix="\n\nWrite your response:\n",
)

ROLE_POOL: dict[str, Role] = {r.name: r for r in [
    Role("Math Solver",
         "You are a math expert. You will be given a math problem and hints from other agents. "
         "Give your own solving process step by step based on hints. The last line of your output "
         "contains only the final result without any units, for example: The answer is 140.",
         **_MATH_GLUE),
    Role("Mathematical Analyst",
         "You are a mathematical analyst. You will be given a math problem, analysis and code from "
         "other agents. You need to first analyze the problem-solving process step by step, where "
         "the variables are represented by letters. Then you substitute the values into the analysis "
         "process to perform calculations and get the results. The last line of your output contains "
         "only the final result without any units.",
         **_MATH_GLUE),
    Role("Programming Expert",
         "You are a programming expert. You will be given a math problem, analysis and code from other "
         "agents. Integrate step-by-step reasoning and Python code to solve math problems. Analyze the "
         "question and write functions to solve the problem. The function should not take any "
         "arguments and use the final result as the return value. The last line of code calls the "
         "function you wrote and assigns the return value to the answer variable.",
         **_MATH_GLUE),
    Role("Inspector",
         "You are an Inspector. You will be given a math problem, analysis and code from other agents. "
         "Check whether the logic and calculation of the problem solving process in the reference "
         "answers are correct, point out every error you find, and give a corrected result when the "
         "references disagree. Keep your report short and end with the final value.",
         **_MATH_GLUE),
    Role("Knowledgeable Expert",
         "You are a knowledgeable expert in question answering. Please give several key entities that "
         "need to be searched in wikipedia to solve the problem, and explain briefly why each of them "
         "matters. Wrap every entity in @ symbols so that a search tool can find it.",
         **_ANALYZE_GLUE),
    Role("Critic",
         "You are an excellent critic. Please point out potential issues in other agents' analysis "
         "point by point, rank them by how much they change the final conclusion, and say which of "
         "the proposed answers you trust most and why.",
         **_ANALYZE_GLUE),
    Role("Historian",
         "You research and analyze cultural, economic, political, and social events in the past, "
         "collect data from primary sources and use it to develop theories about what happened. "
         "Answer with the historical context first, then the conclusion.",
         **_ANALYZE_GLUE),
    Role("Economist",
         "You are an economist. You study how society uses scarce resources, reason with supply, "
         "demand, incentives and trade-offs, and quantify effects whenever the data allow it. "
         "State your assumptions before you give numbers.",
         **_ANALYZE_GLUE),
    Role("Project Manager",
         "You are a project manager. You will be given a function signature and its docstring by "
         "the user. Break the task into a plan that other engineers can follow, name the edge cases "
         "that must be tested, and keep the plan to a few numbered steps.",
         **_CODE_GLUE),
    Role("Test Analyst",
         "You are a test analyst. You will be given a function signature, its docstring and code "
         "from other agents. Write test cases that cover normal inputs, boundaries and failure modes, "
         "run them mentally against the code, and report which ones fail and why.",
         **_CODE_GLUE),
]}

# Presets list eight roles so that up to eight agents get distinct system prompts; the first
# four are the default four-agent workflow (KVComm's GSM8K role cycle for `math`).
ROLE_PRESETS: dict[str, tuple[str, ...]] = {
    "math": ("Math Solver", "Mathematical Analyst", "Programming Expert", "Inspector",
             "Knowledgeable Expert", "Critic", "Economist", "Test Analyst"),
    "analyze": ("Knowledgeable Expert", "Critic", "Historian", "Economist",
                "Mathematical Analyst", "Inspector", "Math Solver", "Project Manager"),
    "code": ("Project Manager", "Programming Expert", "Test Analyst", "Inspector",
             "Critic", "Mathematical Analyst", "Knowledgeable Expert", "Math Solver"),
}
MAX_AGENTS = 8


def roles_for(preset: str, num_agents: int) -> list[Role]:
    if preset not in ROLE_PRESETS:
        raise ValueError(f"unknown role preset {preset!r}; choose from {', '.join(ROLE_PRESETS)}")
    names = ROLE_PRESETS[preset]
    if not 1 <= num_agents <= len(names):
        raise ValueError(f"preset {preset!r} supports 1-{len(names)} agents, not {num_agents}")
    return [ROLE_POOL[name] for name in names[:num_agents]]
