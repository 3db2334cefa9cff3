"""One module per subcommand; ``onnx_qrewrite.cli`` registers them."""
