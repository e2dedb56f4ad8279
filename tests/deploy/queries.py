"""The PromQL the deploy artefacts contain: every dashboard target, the dashboard's variable
query, and every alert rule, plus the "signal" parts of alert expressions (the expression
without its threshold comparison), which must return data under healthy traffic even when
the alert itself is (correctly) silent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "routewise.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"

# What Grafana substitutes before sending a query; the test window must hold several 1 s scrapes.
GRAFANA_SUBSTITUTIONS = {"$__rate_interval": "1m", "$__interval": "15s", "$replica": ".*"}
SET_OPERATORS = ("and", "or", "unless")
COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)\s*(bool\s+)?[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$")
VECTOR_MATCHING = re.compile(r"^\s*(on|ignoring)\s*\([^)]*\)\s*(group_(left|right)\s*(\([^)]*\))?)?\s*")
LABEL_VALUES = re.compile(r"^label_values\(\s*(?P<metric>[^,]+?)\s*,\s*(?P<label>\w+)\s*\)$")


@dataclass(frozen=True)
class Query:
    id: str  # where it comes from, for test ids and messages
    expr: str  # PromQL as Prometheus receives it
    must_have_data: bool  # False: thresholded alert expression, may legitimately be empty

    @property
    def needs_ab(self) -> bool:
        return bool(re.search(r'llm_router_ab_|arm="(treatment|control)"', self.expr))

    @property
    def needs_shadow(self) -> bool:
        return "llm_router_shadow_" in self.expr


def grafana_expand(expr: str) -> str:
    for var, value in GRAFANA_SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    if "$" in expr:
        raise ValueError(f"unsubstituted Grafana variable in {expr!r}")
    return expr


def top_level_split(expr: str) -> list[str]:
    """Operands of the top-level set operators (and/or/unless), outside brackets and strings."""
    parts, depth, quote, start, i = [], 0, None, 0, 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif depth == 0 and c.isalpha() and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:")):
            word = re.match(r"[A-Za-z_]\w*", expr[i:]).group(0)
            if word in SET_OPERATORS:
                parts.append(expr[start:i])
                start = i + len(word)
            i += len(word)
            continue
        i += 1
    parts.append(expr[start:])
    return [VECTOR_MATCHING.sub("", p).strip() for p in parts]


def strip_comparison(operand: str) -> str:
    """`X > 0.05` -> `X` when the comparison is at top level; otherwise unchanged."""
    m = COMPARISON.search(operand)
    if not m:
        return operand
    head = operand[: m.start()]
    depth = sum(head.count(c) for c in "({[") - sum(head.count(c) for c in ")}]")
    return head.strip() if depth == 0 else operand


def alert_signals(expr: str) -> list[str]:
    """The parts of an alert expression that must return data: each set-operator operand, without its threshold."""
    return [strip_comparison(p) for p in top_level_split(expr)]


def dashboard_queries(path: Path = DASHBOARD) -> list[Query]:
    dash = json.loads(path.read_text())
    out: list[Query] = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append(Query(f"panel[{p['title']}/{t['refId']}]", grafana_expand(t["expr"]), True))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = LABEL_VALUES.match(q)
            if not m:
                raise ValueError(f"variable {v['name']}: unsupported query {q!r}")
            out.append(Query(f"variable[{v['name']}]", f"group by ({m['label']}) ({m['metric']})", True))
    return out


def alert_rules(path: Path = ALERTS) -> list[dict]:
    doc = yaml.safe_load(path.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def alert_queries(path: Path = ALERTS) -> list[Query]:
    out: list[Query] = []
    for rule in alert_rules(path):
        name = rule.get("alert") or rule.get("record")
        expr = " ".join(rule["expr"].split())
        out.append(Query(f"alert[{name}]", expr, must_have_data=False))
        for i, signal in enumerate(alert_signals(expr)):
            out.append(Query(f"alert[{name}]/signal{i}", signal, must_have_data=True))
    return out
