"""The `bench one-batch` results table, in layouts that fit the terminal (dsctl/tables.py).

Wide: medians and their spread in separate columns, plus total time. Narrow
(80 columns): each spread goes on a second line under its median, total time is
dropped (overall tok/s says the same). Compact: overall tok/s dropped too and the
lengths in one "in/out" column; with a floor column, then prefill tok/s too. Last
resort (very narrow terminals or huge figures): one wrapping column of figures per
shape, so nothing is ever cut.
Prompt/output lengths are columns only when the run used more than one;
otherwise they are in the title. On CUDA each row also has its decode step's
bytes floor and the step's ratio to it (wide: two columns; narrower: the ratio
under the floor); the note under the table says what the floor is, or why there
is none (CPU).
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from dsctl.bench_one_batch_timing import OneBatchResult
from dsctl.tables import print_fitting


def _ms(seconds: float, digits: int = 2) -> str:
    return f"{seconds * 1e3:.{digits}f}" if math.isfinite(seconds) else "-"


def _rate(v: float) -> str:
    return f"{v:.1f}" if math.isfinite(v) else "-"


def _title(results: list[OneBatchResult], context: str) -> tuple[str, bool]:
    lens = {(r.input_len, r.output_len) for r in results}
    repeats = results[0].repeats if results else 0
    title = f"bench one-batch{': ' + context if context else ''} (median of {repeats} runs after a warm-up"
    if len(lens) == 1:
        (ilen, olen), = lens
        return f"{title}; input {ilen}, output {olen} tokens)", False
    return f"{title})", True


def _floor(r: OneBatchResult) -> str:
    return "-" if r.decode_floor_ms is None else f"{r.decode_floor_ms:.3f}"


def _vs_floor(r: OneBatchResult) -> str:
    v = r.decode_vs_floor
    return "-" if v is None or not math.isfinite(v) else f"x{v:.2f}"


def layouts(results: list[OneBatchResult], context: str = "", note: str = "") -> list:
    title, show_lens = _title(results, context)
    lens = ["in", "out"] if show_lens else []
    floors = any(r.decode_floor_ms is not None for r in results)  # (none on CPU: the note says why)

    def lens_of(r):
        return [str(r.input_len), str(r.output_len)] if show_lens else []

    def table(**kw) -> Table:
        return Table(title=title, caption=note or None, caption_justify="left", **kw)

    wide = table()
    for col in ["batch", *lens, "prefill\nms", "prefill ms\nmin-max", "prefill\ntok/s", "decode\nms",
                "decode ms\np10-p90", "decode\ntok/s", *(["floor\nms", "x\nfloor"] if floors else []), "total\ns",
                "overall\ntok/s"]:
        wide.add_column(col, justify="right", no_wrap=True)
    floor_col = ["floor ms\n(x floor)"] if floors else []
    narrow = table()
    for col in ["batch", *lens, "prefill ms\n(min-max)", "prefill\ntok/s", "decode ms\n(p10-p90)", "decode\ntok/s",
                *floor_col, "overall\ntok/s"]:
        narrow.add_column(col, justify="right", no_wrap=True)
    compact = table()  # narrow, less overall tok/s and with one "in/out" column
    for col in ["batch", *(["in/out"] if show_lens else []), "prefill ms\n(min-max)", "prefill\ntok/s",
                "decode ms\n(p10-p90)", "decode\ntok/s", *floor_col]:
        compact.add_column(col, justify="right", no_wrap=True)
    tight = table()  # compact, less prefill tok/s: room for the floor at 80 columns with several lengths
    for col in ["batch", *(["in/out"] if show_lens else []), "prefill ms\n(min-max)", "decode ms\n(p10-p90)",
                "decode\ntok/s", *floor_col]:
        tight.add_column(col, justify="right", no_wrap=True)
    last = table(show_lines=True)  # always fits: every figure in one wrapping column
    last.add_column("batch" + (", in/out" if show_lens else ""), no_wrap=True)
    last.add_column("prefill, decode (median, spread) and overall")
    for r in results:
        p_spread = f"{_ms(r.prefill_latency_min_s)}-{_ms(r.prefill_latency_max_s)}"
        d_spread = f"{_ms(r.decode_latency_p10_s, 3)}-{_ms(r.decode_latency_p90_s, 3)}"
        wide.add_row(str(r.batch_size), *lens_of(r), _ms(r.prefill_latency_s), p_spread,
                     _rate(r.prefill_throughput_tok_s), _ms(r.median_decode_latency_s, 3), d_spread,
                     _rate(r.median_decode_throughput_tok_s), *([_floor(r), _vs_floor(r)] if floors else []),
                     f"{r.total_latency_s:.3f}", _rate(r.overall_throughput_tok_s))
        cells = (f"{_ms(r.prefill_latency_s)}\n({p_spread})", _rate(r.prefill_throughput_tok_s),
                 f"{_ms(r.median_decode_latency_s, 3)}\n({d_spread})", _rate(r.median_decode_throughput_tok_s),
                 *([f"{_floor(r)}\n({_vs_floor(r)})"] if floors else []))
        narrow.add_row(str(r.batch_size), *lens_of(r), *cells, _rate(r.overall_throughput_tok_s))
        in_out = [f"{r.input_len}/{r.output_len}"] if show_lens else []
        compact.add_row(str(r.batch_size), *in_out, *cells)
        tight.add_row(str(r.batch_size), *in_out, cells[0], *cells[2:])
        last.add_row(str(r.batch_size) + (f", {r.input_len}/{r.output_len}" if show_lens else ""),
                     f"prefill {_ms(r.prefill_latency_s)} ms ({p_spread}), {_rate(r.prefill_throughput_tok_s)} "
                     f"tok/s; decode {_ms(r.median_decode_latency_s, 3)} ms ({d_spread}), "
                     f"{_rate(r.median_decode_throughput_tok_s)} tok/s; "
                     + (f"floor {_floor(r)} ms ({_vs_floor(r)}); " if floors else "")
                     + f"overall {_rate(r.overall_throughput_tok_s)} tok/s")
    return [wide, narrow, compact, *([tight] if floors else []), last]


def print_table(results: list[OneBatchResult], context: str = "", note: str = "") -> None:
    print_fitting(Console(), layouts(results, context, note))
