"""Role presets: prompt-specialized agents, as in the agent sets of multi-agent benchmarks.

Each role has its own system prompt and its own glue text (the agent-specific PF segments of
the paper's Eq. 1); the user query and other agents' outputs are the shared PH segments.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.model.vocabulary import RECALL_ANSWER_PREFIX, ROUTE_ARROWS, ROUTE_WORDS


@dataclass(frozen=True)
class Role:
    name: str
    system: str
    task_intro: str  # PF glue before the shared query
    peer_intro: str  # PF glue before the first peer output
    peer_glue: str  # PF glue before each peer output; {agent} and {role} are filled in
    answer_prefix: str  # PF glue at the end of the prompt
    # `--task role-recall`: which route of a record this role follows (tracegen/tasks/role_recall.py)
    reading: int | None = None
    # `--task role-lookup`: the fact about the request's subject this role reports (a key of
    # tracegen/tasks/role_lookup.py's FACTS)
    reports: str | None = None


_MATH_GLUE = dict(
    task_intro="\n\nProblem: ",
    peer_intro="\n\nOther members of the team have already worked on this problem; their notes follow:",
    peer_glue="\n\nNotes from {agent}, working as the {role}, on this problem:\n\n",
    answer_prefix="\n\nSolution: ",
)
_ANALYZE_GLUE = dict(
    task_intro="\n\nHere is what to work on: ",
    peer_intro="\n\nThe team's earlier contributions are listed below:",
    peer_glue="\n\nContribution of {agent} (the {role}):\n\n",
    answer_prefix="\n\nYour contribution: ",
)
_CODE_GLUE = dict(
    task_intro="\n\nHere is the assignment:\n\n",
    peer_intro="\n\nWhat the rest of the team produced so far, including their review comments:",
    peer_glue="\n\nFrom {agent}, who acts as the {role}:\n\n",
    answer_prefix="\n\nYour reply:\n",
)

_RECALL_GLUE = dict(
    task_intro="\n\nThe tool returned:\n\n",
    peer_intro="\n\nNotes the team wrote so far, in order:",
    peer_glue="\n\n{agent} ({role}) noted:\n",
    answer_prefix=RECALL_ANSWER_PREFIX,
)
_RECALL_RULE = ("Take the name in the last note (or, if there are no notes yet, the name the tool output "
                "starts from), find the line of the table that begins with that name, and write the name "
                "after its arrow on a line of its own. Copy names exactly.")

# `--task role-recall`: a role's system prompt names its reading once, with one of ROUTE_WORDS,
# and the arrow its lines carry (tracegen/tasks/role_recall.py defines the table).
_ROLE_RECALL_RULE = ("Every queue in the table has two lines, one with -> and one with >>. You follow the {word} route: "
                     "take the name in the last note (or, if there are no notes yet, the name the tool output starts "
                     "from), find the line of the table that begins with that name and has {arrow}, and write the name "
                     "after it on a line of its own. Copy names exactly.")

# `--task role-lookup`: the question names the fact in the words its sentence in the tool output
# uses, and the subject (`{subject}`, filled in by the task per trajectory); a small real model
# finds a fact far more often when question and sentence match word for word.
_LOOKUP_GLUE = dict(
    task_intro="\n\nThe tool returned:\n\n",
    peer_intro="\n\nNotes from your teammates:",
    peer_glue="\n\n{role} noted: ",
)
_LOOKUP_ROLES = (("Security Officer", "access code"), ("Travel Planner", "home city"),
                 ("Parking Attendant", "car color"), ("Facilities Manager", "room number"),
                 ("Pet Sitter", "pet"), ("HR Clerk", "department"), ("Event Planner", "birth month"),
                 ("Caterer", "favorite fruit"))

# kvbench's own wording; each role's system prompt keeps about the token length of the agent
# prompts of published multi-agent benchmarks (60-120 tokens), which the PF segments' sizes follow.
ROLE_POOL: dict[str, Role] = {r.name: r for r in [
    Role("Math Solver",
         "Your job on this team is solving arithmetic and algebra problems. Read the problem and any "
         "notes your teammates left, work through it one step at a time, and finish with a single "
         "line that holds only the number, such as: Result: 140.",
         **_MATH_GLUE),
    Role("Mathematical Analyst",
         "Your job on this team is analysis. Before touching any numbers, restate the problem with "
         "named quantities (x for the first unknown, y for the next, and so on) and write down how "
         "they relate. Only then put in the values from the problem, carry out the arithmetic, and "
         "check each intermediate value against the notes of your teammates. Close with one line "
         "holding only the final number, with no units.",
         **_MATH_GLUE),
    Role("Programming Expert",
         "Your job on this team is to turn the problem into a short Python program. Explain in a "
         "sentence or two how you will compute the answer, then write one function with no "
         "parameters that returns the final value, using clear variable names for every quantity "
         "in the problem. After the function, write a line that calls it and stores what it "
         "returns in a variable named answer, so the program can be run as it stands.",
         **_MATH_GLUE),
    Role("Inspector",
         "Your job on this team is review. Go through the reasoning and the code your teammates "
         "wrote, redo every calculation yourself, and list each mistake you find with the place it "
         "occurs. When two teammates reached different results, decide which one holds up and "
         "say why. Be brief and put the corrected final value on the last line.",
         **_MATH_GLUE),
    Role("Knowledgeable Expert",
         "Your job on this team is finding what needs looking up. Name the people, places, events "
         "or terms that an encyclopedia search would have to cover to settle the question, and say "
         "in one sentence what each lookup is for. Put every name between @ signs so that the "
         "search tool can pick it out, for example @Danube@.",
         **_ANALYZE_GLUE),
    Role("Critic",
         "Your job on this team is criticism. Go through your teammates' contributions and list "
         "the weak points one by one, starting with the ones that would change the conclusion most. "
         "Finish by naming the answer you find most convincing and the reason for it.",
         **_ANALYZE_GLUE),
    Role("Historian",
         "Your job on this team is history. You look at what happened in politics, trade, culture "
         "and daily life, base your account on records from the time, and build an explanation of "
         "causes and effects from them. Give the background first and your conclusion after it.",
         **_ANALYZE_GLUE),
    Role("Economist",
         "Your job on this team is economics. Think in terms of costs, prices, incentives and what "
         "people give up when they choose, and put numbers on the effects wherever the figures "
         "allow it. Say which assumptions you rely on before you present any estimate.",
         **_ANALYZE_GLUE),
    Role("Project Manager",
         "Your job on this team is planning. You receive the signature of a function and its "
         "documentation. Split the work into a handful of numbered steps another developer could "
         "follow, and list the unusual inputs that the tests will have to cover.",
         **_CODE_GLUE),
    *[Role(name, f"{duty} {_RECALL_RULE}", **_RECALL_GLUE) for name, duty in (
        ("Table Reader", "Your job on this team is reading tool output: you are the first to look up the start name."),
        ("Link Follower", "Your job on this team is to continue the lookups a teammate started."),
        ("Cross-Checker", "Your job on this team is to take the lookup chain one step further and keep it exact."),
        ("Router", "Your job on this team is routing: each ticket moves to the queue the table names."),
        ("Dispatcher", "Your job on this team is dispatch: you pass work on to whoever the table says."),
        ("Tracer", "Your job on this team is tracing where a request ends up, one hop at a time."),
        ("Auditor", "Your job on this team is auditing the chain: you add the next verified hop."),
        ("Responder", "Your job on this team is giving the answer: the next name in the chain."),
    )],
    # `--task role-recall`: readings alternate along the preset, so consecutive agents read the
    # table differently and a cache written under one reading is wrong for the next agent.
    *[Role(name, f"{duty} " + _ROLE_RECALL_RULE.format(word=ROUTE_WORDS[i % 2], arrow=ROUTE_ARROWS[i % 2]),
           **_RECALL_GLUE, reading=i % 2)
      for i, (name, duty) in enumerate((
          ("Route Planner", "Your job on this team is planning where a ticket goes first."),
          ("Failover Officer", "Your job on this team is failover: you send work where it goes when a queue is down."),
          ("Queue Router", "Your job on this team is routing tickets between queues."),
          ("Recovery Lead", "Your job on this team is recovery planning for queues that stopped."),
          ("Shift Dispatcher", "Your job on this team is dispatching the work of each shift."),
          ("Outage Handler", "Your job on this team is handling outages, one queue at a time."),
          ("Ticket Tracer", "Your job on this team is tracing where a ticket ends up."),
          ("Continuity Auditor", "Your job on this team is auditing the plan that keeps work moving."),
      ))],
    *[Role(name, f"You are the {name} of the team. You report the {fact} of the person a request is about, "
                 "and nothing else.",
           answer_prefix=f"\n\nWhat is the {fact} of {{subject}}? Answer in one short sentence.",
           **_LOOKUP_GLUE, reports=fact)
      for name, fact in _LOOKUP_ROLES],
    Role("Test Analyst",
         "Your job on this team is testing. Given a function signature, its documentation and your "
         "teammates' code, write test cases for ordinary inputs, edge values and invalid calls, "
         "trace each one through the code by hand, and report the ones that fail and why.",
         **_CODE_GLUE),
]}

# Presets list eight roles so that up to eight agents get distinct system prompts; the first
# four are the default four-agent workflow (for `math`: solver, analyst, programmer, reviewer).
ROLE_PRESETS: dict[str, tuple[str, ...]] = {
    "math": ("Math Solver", "Mathematical Analyst", "Programming Expert", "Inspector",
             "Knowledgeable Expert", "Critic", "Economist", "Test Analyst"),
    "analyze": ("Knowledgeable Expert", "Critic", "Historian", "Economist",
                "Mathematical Analyst", "Inspector", "Math Solver", "Project Manager"),
    "code": ("Project Manager", "Programming Expert", "Test Analyst", "Inspector",
             "Critic", "Mathematical Analyst", "Knowledgeable Expert", "Math Solver"),
    # for `--task recall`: the four-agent default ends with the Responder
    "recall": ("Table Reader", "Link Follower", "Cross-Checker", "Responder",
               "Router", "Dispatcher", "Tracer", "Auditor"),
    # for `--task role-recall`: main and fallback readings alternate
    "role-recall": ("Route Planner", "Failover Officer", "Queue Router", "Recovery Lead",
                    "Shift Dispatcher", "Outage Handler", "Ticket Tracer", "Continuity Auditor"),
    # for `--task role-recall` where every agent follows the main route (its even-numbered roles): a
    # control without cross-role difference, and the same-adapter scenario of adapter traces
    "role-recall-main": ("Route Planner", "Queue Router", "Shift Dispatcher", "Ticket Tracer"),
    # for `--task role-lookup`: each agent reports another fact about the request's subject
    "role-lookup": tuple(name for name, _ in _LOOKUP_ROLES),
}
MAX_AGENTS = 8


def roles_for(preset: str, num_agents: int) -> list[Role]:
    if preset not in ROLE_PRESETS:
        raise ValueError(f"unknown role preset {preset!r}; choose from {', '.join(ROLE_PRESETS)}")
    names = ROLE_PRESETS[preset]
    if not 1 <= num_agents <= len(names):
        raise ValueError(f"preset {preset!r} supports 1-{len(names)} agents, not {num_agents}")
    return [ROLE_POOL[name] for name in names[:num_agents]]
