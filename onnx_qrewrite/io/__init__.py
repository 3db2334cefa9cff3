"""Reading and writing models: bounded parsing, contained external data, atomic commits.

Everything here touches files or wire bytes and nothing else: the rewriter never opens a path
itself, and every output goes through :mod:`onnx_qrewrite.io.outputs`' journaled commit.
"""
