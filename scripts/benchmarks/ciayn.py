"""CIAYN's own cost per step, in the controller, before and after the executor: parse the model's
line, validate it against the tool's spec, fingerprint it (repeat detection), encode the call for
the wire and decode the result that comes back. Timed in-process with ``parse.measure``; the
grammar's wider table of cases (``parse``) is refreshed alongside."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

from protocol import Result, Stats, WorkerInfo, decode, encode, fingerprint, parse_call, parse_calls

from . import parse, report
from .record import log, measured
from .registry import Context, figure

TEXT = 'read_file(path="src/main.py", start=10, lines=40)'


@figure(
    "ciayn_overhead",
    "CIAYN's own cost per step in the controller (parse, validate, fingerprint, codec)",
    order=80, chart=report.chart_ciayn, table=report.table_ciayn,
)
def ciayn_overhead(context: Context) -> dict[str, Any]:
    repeat, out_dir = context.sizes.microbench_repeat, context.out
    log("CIAYN per-step overhead and the grammar cases")
    spec = parse.TOOLS["read_file"]
    call = parse_call(TEXT)
    sent = call.model_copy(update={"id": "0123456789abcdef0123456789abcdef-1"})
    reply = encode(Result(id=sent.id or "", ok=True, value="x" * 200, worker=WorkerInfo(id=0, pid=1, incarnation=1),
                          stats=Stats(wall_s=0.0001, cpu_s=0.0001, peak_rss_kb=30000)))
    stages = {
        "parse (grammar, ast)": lambda: parse_call(TEXT),
        "validate (bind to the tool's signature)": lambda: spec.bind(call.args, call.kwargs),
        "parse + validate as the agent does (parse_calls with tools)": lambda: parse_calls(TEXT, parse.TOOLS),
        "fingerprint (repeat detection)": lambda: fingerprint(call, spec),
        "encode the call (protocol.encode)": lambda: encode(sent),
        "decode the result (protocol.decode)": lambda: decode(reply),
    }
    timings = {name: parse.measure(fn, repeat) for name, fn in stages.items()}
    step = ["parse + validate as the agent does (parse_calls with tools)", "fingerprint (repeat detection)",
            "encode the call (protocol.encode)", "decode the result (protocol.decode)"]
    parse_json = out_dir / "parse.json"
    with contextlib.redirect_stdout(io.StringIO()):
        parse.main(["--out", str(parse_json), "--repeat", str(max(3, repeat))])
    return measured(
        title="CIAYN overhead per step (controller side)",
        text=TEXT,
        stages_us={name: {"p50": t["median_us"], "p90": t["p90_us"]} for name, t in timings.items()},
        step_total_us=round(sum(timings[name]["median_us"] for name in step), 2),
        step_total_is="parse + validate, fingerprint, encode the call, decode the result",
        grammar_cases=json.loads(parse_json.read_text())["cases"],
    )
