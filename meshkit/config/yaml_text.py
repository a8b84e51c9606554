"""YAML from users, read with a bound: aliases may not expand a document past `MAX_NODES` nodes.

A YAML alias is a reference, so a few hundred bytes can describe billions of values ("billion laughs");
anything that walks the result (validation, printing a value in an error) would then run out of time or
memory. The bound is counted on the composed node graph, before any Python object is built.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_NODES = 100_000  # far above any real config (the full schema has ~100 keys)


class YAMLBombError(yaml.YAMLError):
    """The document expands past the bound, or refers to itself."""


def load_yaml(text: str) -> Any:
    """`yaml.safe_load` with the expansion bound; raises yaml.YAMLError (bounded message) on bad input."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise YAMLBombError("the document is nested too deeply") from None


class _BoundedLoader(yaml.SafeLoader):
    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {}, set())
        return node


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes in the document once every alias is replaced by what it names (each shared node sized once)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise YAMLBombError(f"an alias refers to a node that contains it (line {node.start_mark.line + 1})")
    open_nodes.add(key)
    total = 1
    for child in _children(node):
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_NODES:
            raise YAMLBombError(
                f"aliases expand the document past {MAX_NODES} values (line {node.start_mark.line + 1}): "
                "write the values out instead of nesting aliases"
            )
    open_nodes.discard(key)
    sizes[key] = total
    return total
