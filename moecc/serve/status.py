"""The status page at `/`: every batch of the caller with its state, a progress bar,
requests done and failed, tokens/s and ETA; for the running one its model's plan (explain's
summary) and predicted timeline. Plain HTML and CSS, refreshed by a meta refresh: no
JavaScript at all.

Needs: batch rows (store.py), the runner's Live figures, the served models. Does: renders
one page. Guarantees: every client string on it (ids are the server's, but metadata and
file names are not) is HTML-escaped; each batch's row carries its counts as data
attributes (`data-completed`, `data-failed`, `data-total`) as well as in its text.
"""

from __future__ import annotations

import html
import json
import time
from typing import Any

from moecc.serve.plans import ServedModel
from moecc.serve.runner import Live

REFRESH_S = 2
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} .sub{color:#666;margin-bottom:16px}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{border-bottom:1px solid #e3e3e3;padding:6px 8px;text-align:left;vertical-align:middle}
th{background:#f0f0f0;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
.bar{width:220px;height:14px;background:#e8e8e8;border-radius:7px;overflow:hidden;display:flex}
.bar .ok{background:#3a9d4a} .bar .bad{background:#d64545}
.st{padding:1px 8px;border-radius:9px;font-size:12px;color:#fff;background:#888}
.st.in_progress,.st.validating,.st.finalizing{background:#2f6fd6} .st.completed{background:#3a9d4a}
.st.failed,.st.expired{background:#d64545} .st.cancelling,.st.cancelled{background:#c98a16}
pre{background:#fff;border:1px solid #e3e3e3;padding:10px;overflow:auto;font-size:12px}
.why{color:#a33;font-size:12px} .when{white-space:nowrap}
.running{margin-top:20px} .svg{background:#fff;border:1px solid #e3e3e3;overflow:auto}
"""


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _rates(row: dict[str, Any], live: Live | None) -> tuple[str, str]:
    """(tokens/s, ETA) as shown: live for the running batch, over its run for a finished one."""
    if live is not None and live.batch_id == row["id"]:
        return f"{live.tokens_per_s:.1f}", _clock(live.eta_s)
    end = row["completed_at"] or row["cancelled_at"] or row["expired_at"] or row["failed_at"]
    start = row["in_progress_at"]
    if start and end and row["output_tokens"]:
        return f"{row['output_tokens'] / max(1, end - start):.1f}", "-"
    return "-", "-"


def _why(row: dict[str, Any]) -> str:
    """A failed batch's first error, small, after its status."""
    if not row["errors"]:
        return ""
    first = (json.loads(row["errors"]).get("data") or [{}])[0]
    text = f'{first.get("code") or ""}: {str(first.get("message"))[:120]}'
    return f' <span class="why">{html.escape(text)}</span>'


def _row(row: dict[str, Any], live: Live | None) -> str:
    total, ok, bad = row["total"], row["completed"], row["failed"]
    width_ok = 100.0 * ok / total if total else 0.0
    width_bad = 100.0 * bad / total if total else 0.0
    pct = 100.0 * (ok + bad) / total if total else (100.0 if row["status"] == "completed" else 0.0)
    rate, eta = _rates(row, live)
    e = html.escape
    return (f'<tr class="batch" data-batch="{e(row["id"])}" data-status="{e(row["status"])}" '
            f'data-completed="{ok}" data-failed="{bad}" data-total="{total}">'
            f'<td><code>{e(row["id"])}</code></td>'
            f'<td><span class="st {e(row["status"])}">{e(row["status"])}</span>{_why(row)}</td>'
            f'<td><div class="bar" title="{pct:.0f}%"><div class="ok" style="width:{width_ok:.2f}%"></div>'
            f'<div class="bad" style="width:{width_bad:.2f}%"></div></div></td>'
            f'<td class="num">{pct:.0f}%</td><td class="num done">{ok + bad}/{total}</td>'
            f'<td class="num failed">{bad}</td><td class="num">{e(rate)}</td><td class="num">{e(eta)}</td>'
            f'<td class="when">{e(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["created_at"])))}</td></tr>')


def render(rows: list[dict[str, Any]], live: Live | None, models: dict[str, ServedModel],
           active: tuple[str, ...]) -> str:
    """The whole page."""
    e = html.escape
    body = [f"<h1>moecc serve</h1><div class='sub'>models: {e(', '.join(models))}; "
            f"{sum(r['status'] in active for r in rows)} batches not finished; refreshes every {REFRESH_S}s</div>",
            "<table><tr><th>batch</th><th>status</th><th>progress</th><th></th><th>done/total</th>"
            "<th>failed</th><th>tok/s</th><th>ETA</th><th>created</th></tr>"]
    body += [_row(r, live) for r in rows]
    body.append("</table>" if rows else "<tr><td colspan=9>no batches yet</td></tr></table>")
    if live is not None and live.model in models and any(r["id"] == live.batch_id for r in rows):  # its owner only
        m = models[live.model]
        body.append(f"<div class='running'><h2>running: <code>{e(live.batch_id)}</code> on {e(m.name)}</h2>"
                    f"<pre>{e(m.explain)}</pre>"
                    + (f"<div class='svg'>{m.timeline_svg[m.timeline_svg.find('<svg'):]}</div>"
                       if "<svg" in m.timeline_svg else "")
                    + "</div>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='{REFRESH_S}'>"
            f"<title>moecc serve</title><style>{_CSS}</style></head><body>{''.join(body)}</body></html>")


def login_page(message: str) -> str:
    """The page a browser without a key gets: how to give one."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>moecc serve</title></head><body>"
            f"<h1>moecc serve</h1><p>{html.escape(message)}</p><p>Open <code>/?key=YOUR_KEY</code> once: the key "
            f"is kept in a cookie for this site.</p></body></html>")
