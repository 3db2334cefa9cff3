"""Rewriting: the rule catalogue (policy, from ``rules/``), the builders behind one contract
(mechanism), and the engine that matches and applies them.

Data flows one way: :mod:`.catalogue` loads and validates rules against :mod:`.contract`,
:mod:`.engine` runs the passes: :mod:`.matching` decides which rule rewrites which node,
:mod:`.apply` has :mod:`.builders` build the replacements and :mod:`.splice` puts them in place;
:mod:`.report` records what happened and :mod:`.provenance` keeps it recoverable from the saved
model.
"""
