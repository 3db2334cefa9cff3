"""Rewriting: the rule catalogue (policy, from ``rules/``), the builders behind one contract
(mechanism), and the engine that matches and applies them.

Data flows one way: :mod:`.catalogue` loads and validates rules against :mod:`.contract`,
:mod:`.engine` matches nodes and has :mod:`.builders` build the replacements, :mod:`.report`
records what happened and :mod:`.provenance` keeps it recoverable from the saved model.
"""
