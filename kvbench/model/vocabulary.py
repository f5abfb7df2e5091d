"""The words and markers of the recall tasks the embedded models are built to read: the
constructed circuits and role models (kvbench.model.recall_build, kvbench.model.roles) are wired
to these tokens, and `gen-trace --task recall|role-recall` (kvbench.tracegen) writes its traces
with them."""

from __future__ import annotations

# Names are two of these words: single tokens for most BPE vocabularies.
NAME_WORDS = (
    "amber anchor apple arrow aspen autumn badge basin beacon birch blade bloom bramble breeze brick "
    "brook cabin canal candle canyon carbon cedar chalk cherry cinder clover cobalt comet copper coral "
    "crane crater crystal dawn delta desert dune eagle ember falcon fern fiber flint forest fossil "
    "garnet glacier granite harbor hazel heron hollow iris island ivory jade jasper kettle lagoon lantern "
    "laurel lemon linen lotus maple marble meadow mesa mist moss nectar oak ocean olive onyx orchid "
    "otter pebble pepper pine planet plum polar poplar prairie quartz quill raven reef ridge river "
    "robin ruby saddle sage salt sand shadow shell silver slate spruce stone storm summit sunset "
    "thistle thunder tide timber topaz tulip tundra valley velvet violet walnut willow winter zephyr"
).split()

ARROW = " -> "

# The question that ends every recall prompt; the recall model's circuit is built around its length.
RECALL_ANSWER_PREFIX = "\n\nNext name:\n"

# `--task role-recall`: the route a role's system prompt names, and the arrow its table lines carry.
ROUTE_WORDS = ("main", "fallback")
ROUTE_ARROWS = ("->", ">>")
