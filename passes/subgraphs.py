"""A node's subgraphs (If branches, Loop and Scan bodies): read off its attributes here only."""

from __future__ import annotations

import onnx_ir as ir


def node_subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs ``node`` holds directly, in attribute order (not the ones nested in them)."""
    graphs: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.as_graph())
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs.extend(attr.as_graphs())
    return graphs


def has_subgraphs(node: ir.Node) -> bool:
    """Does ``node`` hold a graph (If, Loop, Scan, a function-valued attribute)?"""
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())


def nested_graphs(graph: ir.Graph) -> list[ir.Graph]:
    """``graph`` and every graph nested in it, at any depth."""
    found = [graph]
    for node in ir.traversal.RecursiveGraphIterator(graph):
        found.extend(node_subgraphs(node))
    return found
