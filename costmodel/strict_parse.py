"""YAML and JSON text to Python values, refusing a mapping key given twice.

PyYAML and json keep the last of two equal keys silently, so a profile or spec file that sets a
field twice would be read with whichever came last. Errors are raised as the parsers' own
(`yaml.YAMLError`, `ValueError`); callers turn them into one-line messages.
"""
from __future__ import annotations

import json
from typing import Any

import yaml


MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping key written twice (a key a merge `<<: *anchor`
    brings in may still be overridden, as YAML allows)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    twice = key in seen
                except TypeError:  # a list or mapping as a key
                    raise yaml.constructor.ConstructorError(None, None, "found an unhashable key", key_node.start_mark) from None
                if twice:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    keys = [key for key, _ in pairs]
    twice = next((key for key in keys if keys.count(key) > 1), None)
    if twice is not None:
        raise ValueError(f"key {twice!r} given twice")
    return dict(pairs)


def load_text(text: str, is_json: bool) -> Any:
    """The value of YAML (or, with `is_json`, strict JSON) `text`.

    Raises:
        yaml.YAMLError: invalid YAML, or a YAML key given twice.
        ValueError: invalid JSON (json.JSONDecodeError), or a JSON key given twice.
    """
    return json.loads(text, object_pairs_hook=_unique_pairs) if is_json else yaml.load(text, Loader=_UniqueKeyLoader)
