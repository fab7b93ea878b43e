"""The modules read top to bottom: every function is defined before it is used, and the gradient's
path from icl_ref.loss_and_grad to the layer is a chain of named calls.

    python3 tools/layout.py          # prints the path and its hops; exit 1 on a violation

Checked (MATH.md's notes on the code):
- in each module, a top-level function or class uses only module-level names defined above it (a
  function may call itself);
- from icl_ref.loss_and_grad, calls by name (not through a lambda, a functools.partial or an
  attribute) reach layer_forward and layer_backward, and no function on the way holds a lambda.
A layout rule, not a result: the test suite does not depend on the order of a module's functions
(.ci/run runs this check beside it).
"""
import ast
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ("icl_ref.py", "icl_check.py", "icl_looped.py", "icl_estimators.py", "icl_fast.py", "icl_files.py")


def used_before_defined(source):
    """[(function, name)] where a top-level function or class of `source` uses a module-level name
    that is defined only further down."""
    tree = ast.parse(source)
    defined = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.setdefault(node.name, node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        defined.setdefault(n.id, node.lineno)
    late = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            late += [(node.name, name) for name in sorted(names)
                     if name != node.name and defined.get(name, 0) > node.lineno]
    return late


def named_path(source, start, targets):
    """{target: [start, ..., target]}: the shortest chains of calls by name (f(...), f a module-level
    function) from `start` to each target reached; and the functions on those chains that hold a
    lambda or name functools.partial."""
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    previous, queue = {start: None}, collections.deque([start])
    while queue:
        f = queue.popleft()
        callees = sorted({c.func.id for c in ast.walk(functions[f]) if isinstance(c, ast.Call)
                          and isinstance(c.func, ast.Name) and c.func.id in functions})
        for g in callees:
            if g not in previous:
                previous[g] = f
                queue.append(g)
    paths = {}
    for target in targets:
        if target in previous:
            path = [target]
            while previous[path[-1]] is not None:
                path.append(previous[path[-1]])
            paths[target] = path[::-1]
    on_path = {f for path in paths.values() for f in path}
    indirect = sorted(f for f in on_path if any(isinstance(n, ast.Lambda) or (isinstance(n, (ast.Name, ast.Attribute))
                      and getattr(n, "id", getattr(n, "attr", None)) == "partial") for n in ast.walk(functions[f])))
    return paths, indirect


def main():
    problems = []
    for module in MODULES:
        with open(os.path.join(ROOT, module), encoding="utf-8") as f:
            source = f.read()
        problems += [f"{module}: {fn} uses {name}, defined further down" for fn, name in used_before_defined(source)]
        if module == "icl_ref.py":
            paths, indirect = named_path(source, "loss_and_grad", ("layer_forward", "layer_backward"))
            for target in ("layer_forward", "layer_backward"):
                if target in paths:
                    print(f"{len(paths[target]) - 1} hops: {' -> '.join(paths[target])}")
                else:
                    problems.append(f"icl_ref.py: no chain of named calls from loss_and_grad to {target}")
            problems += [f"icl_ref.py: {fn}, on the gradient's path, holds a lambda or a partial" for fn in indirect]
    for p in problems:
        print(p, file=sys.stderr)
    print("layout: " + (f"{len(problems)} problems" if problems else "every function defined before it is used"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
