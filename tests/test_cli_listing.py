"""What a new user asks the CLI about itself: its version, the methods and peers with their syntax and settings."""

from __future__ import annotations

import json

from test_cli_errors import run_cli

from treegraft_cli import __version__
from treegraft_cli.bench.contenders import PEERS
from treegraft_cli.methods import METHODS, method_names


def test_version(capsys, monkeypatch):
    code, out, _ = run_cli(["--version"], capsys, monkeypatch)
    assert code == 0 and out.startswith(f"treegraft {__version__} (torch ")


def test_methods_json_lists_the_registry(capsys, monkeypatch):
    code, out, _ = run_cli(["methods", "--json"], capsys, monkeypatch)
    listing = json.loads(out)
    methods = {m["name"]: m for m in listing["methods"]}
    assert code == 0 and list(methods) == method_names() and [p["name"] for p in listing["peers"]] == sorted(PEERS)
    assert methods["fixed"]["syntax"] == "fixed:L[,L...]" and "required" in methods["fixed"]["argument"]
    assert methods["treegraft"]["syntax"] == "treegraft[:POLICY]" and "cost-aware" in methods["treegraft"]["argument"]
    assert methods["dense"]["syntax"] == "dense" and methods["dense"]["needs_drafter"] and methods["dense"]["options"] == []
    graft = {o["key"]: o for o in methods["graft"]["options"]}
    assert graft["thresholds"] == {"key": "thresholds", "type": "a list of numbers", "default": [0.35, 0.2, 0.05]}
    for name, method in methods.items():
        assert method["description"] == METHODS[name].description != ""


def test_methods_table_shows_syntax_and_option_defaults(capsys, monkeypatch):
    code, out, _ = run_cli(["methods"], capsys, monkeypatch)
    assert code == 0
    for needle in ("fixed:L[,L...]", "treegraft[:POLICY]", "hf-assisted", "peer (bench)", "call_budget", "[0.35, 0.2, 0.05]"):
        assert needle in out


def test_bench_help_says_how_long_it_takes(capsys, monkeypatch):
    code, out, _ = run_cli(["bench", "--help"], capsys, monkeypatch)
    assert code == 0 and "minutes on 2 quiet CPU cores" in " ".join(out.split())
