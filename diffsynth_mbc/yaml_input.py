"""Every YAML file a user gives (a preset's ``--config``, ``--datasets FILE``, ``--sample_prompts FILE``) is read
here, and only here: ``load_yaml``. No torch.

``yaml.safe_load`` makes an alias the same object again, so a 9-line "billion laughs" file (each line a list of 9
aliases of the line before) loads in milliseconds as a list that *holds* 9^9 items through a few shared lists. What
walks it afterwards walks every alias expanded: ``repr`` in an error message was 80 MB for 9 lines and 802 MB for
one more level. So the document's node graph is composed first and its size with every alias expanded is counted,
each node's size once (nothing is expanded); a document whose aliases add more than ``MAX_NODES`` values to those
written in it is refused, naming the file, before a Python object is built. A file without aliases is as large as its
text and is not limited here. An alias of a node inside that node (a document that contains itself) is refused too.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from diffsynth_mbc.errors import OptionsError

MAX_NODES = 100_000   # values (mappings, lists, scalars) a document's aliases may add to those written in it
_CAP = 2**62          # sizes are counted up to here: a bomb of a thousand lines would be a number of 900 digits


class YamlInputError(OptionsError):
    """A YAML file that cannot be read; the message names the flag and the file."""


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def expanded_size(root) -> tuple[int, int]:
    """(values with aliases expanded, counted up to 2**62; distinct nodes) of a composed YAML node graph.
    Each node is sized once (depth-first, without recursion); ValueError when a node holds an alias of itself."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = min(_CAP, 1 + sum(sizes[id(child)] for child in _children(node)))
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise ValueError("an alias refers to a node that holds it (the document would contain itself)")
        open_nodes.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_nodes:
                raise ValueError("an alias refers to a node that holds it (the document would contain itself)")
            if id(child) not in sizes:
                stack.append((child, False))
    return sizes[id(root)], len(sizes)


def parse_yaml(text: str, where: str, limit: int = MAX_NODES):
    """The Python value of a YAML document (``where`` names it in errors: the flag and the file)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            expanded, distinct = expanded_size(node)
        except ValueError as exc:
            raise YamlInputError(f"{where}: refused: {exc}") from None
        if expanded - distinct > limit:
            raise YamlInputError(f"{where}: refused: its aliases (*name) add more than {limit:,} values to the "
                                 f"{distinct:,} written; a preset, a catalogue list or a prompt file needs far fewer")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise YamlInputError(f"{where} is not valid YAML: {exc}") from None
    except RecursionError:
        raise YamlInputError(f"{where} is not valid YAML: it is nested too deeply") from None
    except YamlInputError:
        raise
    except (ValueError, OverflowError) as exc:   # e.g. an integer of more digits than Python reads
        raise YamlInputError(f"{where}: a value cannot be read: {str(exc)[:200]}") from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path, flag: str):
    """The value of the YAML file ``path`` given as ``flag``; FileNotFoundError passes through (each caller names
    the flag), every other problem is a YamlInputError naming ``flag`` and the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise YamlInputError(f"{flag}: {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except IsADirectoryError:
        raise YamlInputError(f"{flag}: {path} is a folder, not a YAML file") from None
    return parse_yaml(text, f"{flag}: {path}")
