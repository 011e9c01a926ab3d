"""The house's layout: utils/ is a set of modules that import each other without a circle, so each can be read, and
imported, on its own."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def utils_imports():
    """Each utils module's name and the utils modules it imports, at its top or inside a function alike (an import
    put in a function to break a circle still is one)."""
    graph = {}
    for path in sorted((REPO / "utils").glob("*.py")):
        name = "utils" if path.stem == "__init__" else f"utils.{path.stem}"
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("utils"):
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)  # from utils import gpt
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names if alias.name.startswith("utils"))
        graph[name] = imported
    return {name: sorted(imported & graph.keys() - {name}) for name, imported in graph.items()}


def test_no_utils_module_imports_itself_through_others():
    graph = utils_imports()
    # The package's __init__ gathers what the steps use: its modules never import from it.
    assert not [name for name, imported in graph.items() if "utils" in imported], graph
    circles = []

    def visit(name, path):
        for imported in graph[name]:
            if imported in path:
                circles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in done:
                visit(imported, path + [imported])
        done.add(name)

    done = set()
    for name in graph:
        if name not in done:
            visit(name, [name])
    assert not circles, f"import circles in utils/: {sorted(set(circles))}"
