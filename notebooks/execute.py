"""Run every walkthrough notebook top to bottom and store its outputs in the file, as a web viewer shows them.

    python notebooks/execute.py                       # all notebooks/*.ipynb
    python notebooks/execute.py notebooks/02_*.ipynb  # some

Run it after changing a notebook or a step script, then commit the notebooks. `make test` runs them too (nbval),
comparing the cells marked `# NBVAL_CHECK_OUTPUT` with the stored outputs.
"""
import argparse
import sys
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import start_new_kernel

HERE = Path(__file__).resolve().parent


def execute(path, cell_timeout=600):
    """Execute the notebook at `path` in a fresh kernel (in the notebook's directory) and write the outputs back."""
    notebook = nbformat.read(path, as_version=4)
    manager, client = start_new_kernel(kernel_name=notebook.metadata.kernelspec.name, cwd=str(path.parent))
    try:
        for count, cell in enumerate((cell for cell in notebook.cells if cell.cell_type == "code"), start=1):
            msg_id = client.execute(cell.source)
            outputs = []
            while True:
                msg = client.get_iopub_msg(timeout=cell_timeout)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "status" and content["execution_state"] == "idle":
                    break
                if kind == "clear_output":
                    outputs = []
                elif kind == "stream" and outputs and outputs[-1].get("name") == content["name"]:
                    outputs[-1]["text"] += content["text"]  # one block per stream, as Jupyter shows it
                elif kind in ("stream", "display_data", "execute_result", "error"):
                    outputs.append(nbformat.v4.output_from_msg(msg))
            cell.outputs, cell.execution_count = outputs, count
            if any(output.output_type == "error" for output in outputs):
                raise SystemExit(f"error: {path.name}, cell {count} failed:\n" + "\n".join(outputs[-1].traceback))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    nbformat.write(notebook, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path, help="Notebooks to run (default: all)")
    args = parser.parse_args()
    for path in args.notebooks or sorted(HERE.glob("*.ipynb")):
        began = time.perf_counter()
        execute(path.resolve())
        print(f"{path.name}: {time.perf_counter() - began:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
