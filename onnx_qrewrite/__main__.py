from onnx_qrewrite.cli import run

if __name__ == "__main__":
    run()
