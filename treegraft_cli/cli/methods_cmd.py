"""`treegraft methods`: every method and peer with its syntax, what it needs and its -o settings, from the registry."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from ..bench.contenders import PEERS
from ..methods import METHODS, method_names
from . import console


def catalog() -> dict[str, Any]:
    """Methods (registry order by name) and peers, as plain data."""
    methods = []
    for name in method_names():
        cls = METHODS[name]
        methods.append({
            "name": name,
            "syntax": cls.syntax(),
            "needs_drafter": cls.needs_drafter,
            "description": cls.description,
            "argument": cls.argument_help if cls.argument else "",
            "options_class": cls.options_class.__name__ if cls.options_class else None,
            "options": [{"key": f.key, "type": f.type, "default": f.default} for f in cls.option_fields()],
        })
    peers = [{"name": name, "syntax": name, "needs_drafter": peer.needs_drafter, "description": peer.description}
             for name, peer in sorted(PEERS.items())]
    return {"methods": methods, "peers": peers}


def methods(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """List methods and peers: --method / --methods syntax, drafter needs, description, -o settings and defaults."""
    listing = catalog()
    if as_json:
        console.json_line(listing)
        return
    rows = [(m["syntax"], "method", "yes" if m["needs_drafter"] else "-",
             m["description"] + (f"; {m['argument']}" if m["argument"] else "")) for m in listing["methods"]]
    rows += [(p["syntax"], "peer (bench)", "yes" if p["needs_drafter"] else "-", p["description"]) for p in listing["peers"]]
    console.listing("methods (--method NAME, bench --methods a,b) and bench peers", ["syntax", "kind", "drafter", "description"], rows)
    shared: dict[str, list[dict[str, Any]]] = {}
    for method in listing["methods"]:
        if method["options"]:
            shared.setdefault(method["options_class"], []).append(method)
    for group in shared.values():
        names = ", ".join(m["name"] for m in group)
        console.listing(f"-o KEY=VALUE settings of {names}", ["key", "type", "default"],
                      [(o["key"], o["type"], json.dumps(o["default"])) for o in group[0]["options"]])
    bare = [m["name"] for m in listing["methods"] if not m["options"]]
    console.result(f"no -o settings: {', '.join(bare)} and the peers. Values are YAML: -o thresholds=[0.3,0.2,0.05].")
