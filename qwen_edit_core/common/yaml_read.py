"""Reading config YAML: YAML 1.2's number rule, and a bound on what a document may expand to.

PyYAML's safe loader reads YAML 1.1, where `1e-3` is a string; configs are written as people write numbers.
Aliases (`&name` / `*name`) share one node, so a small document of nested aliases (a "billion laughs" bomb)
expands to billions of values as soon as anything walks it (turning it into strings, printing it, comparing
it); the loader refuses such a document before building any Python object from it.
"""

from __future__ import annotations

import re

import yaml


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's float rule: `1e-3`, `3E5`, `.5` are numbers (1.1 reads strings)."""


_Yaml12Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


#: most values (scalars, lists, mappings) a config may expand to, aliases counted at each use: a real config
#: holds a few hundred; nested aliases (a "billion laughs" document) expand to billions and would hang the run
MAX_YAML_VALUES = 100_000


class YamlTooLargeError(yaml.YAMLError):
    """A YAML document whose aliases expand to more than MAX_YAML_VALUES values, or refer to themselves."""


def expanded_values(node: yaml.Node, limit: int = MAX_YAML_VALUES) -> int:
    """How many values `node` holds once every alias is expanded (counted on the composed node graph, where an
    alias is the anchored node itself, so this takes time in the number of distinct nodes); YamlTooLargeError
    past `limit` or for an alias inside its own anchor."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(n: yaml.Node) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in active:
            raise YamlTooLargeError(f"an alias refers to its own anchor (line {n.start_mark.line + 1}); write the "
                                    "value out")
        active.add(id(n))
        if isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        else:
            children = n.value if isinstance(n, yaml.SequenceNode) else []
        total = 1 + sum(size(c) for c in children)
        active.discard(id(n))
        if total > limit:
            raise YamlTooLargeError(f"the document expands to more than {limit} values through its aliases (&name "
                                    "/ *name); a config holds a few hundred: write the values out")
        sizes[id(n)] = total
        return total
    return size(node)


class _BoundedLoader(_Yaml12Loader):
    """The YAML 1.2 loader that refuses documents expanding to more than MAX_YAML_VALUES values before building
    any Python object from them."""

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            expanded_values(node)
        return node


def read_yaml(text: str):
    """Parse YAML text with the YAML 1.2 number rule (`lr: 1e-3` is a float), refusing alias bombs
    (YamlTooLargeError, see MAX_YAML_VALUES)."""
    return yaml.load(text, Loader=_BoundedLoader)
