"""``sweep.html``: one offline page (no script, no request; the clips beside it by relative path): a summary at the
top (the best file, its loss and gain, its run; the runs; the validation's settings), then the prompts down and the
base model and every file across (one column per file and strength: the best file's first, then the others by
step), each clip looping, each column headed by its file, its run when the sweep holds several, its step and
validation figures (measured at strength 1 only: other strengths say so), the best file marked. Pure: no torch."""

from __future__ import annotations

from html import escape

from diffsynth_mbc.sample.sweep_plan import gain_words
from diffsynth_mbc.sample_prompts import strength_text

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ddd; padding: 6px; vertical-align: top; }
th { background: #f6f6f6; font-weight: 600; text-align: left; min-width: 140px; }
th.best, td.best { background: #fff4d6; }
td.prompt { max-width: 260px; }
video, img { display: block; max-width: 240px; max-height: 240px; }
.figures { font-weight: 400; color: #555; font-size: 12px; }
.missing { color: #a00; font-size: 12px; }
.summary { margin: 0 0 12px; padding: 8px 12px; background: #fff4d6; border: 1px solid #ecd9a0; max-width: 1100px; }
.summary div { margin: 2px 0; }
"""
NOT_VALIDATED = "not validated: the validation measures strength 1"


def column_head(column: dict, best_key: str | None) -> str:
    if column["file"] is None:
        lines = ["strength 0", _loss(column.get("val_loss"), None)]
        return f'<th>base model{_figures(lines)}</th>'
    item = column["file"]
    best = item["key"] == best_key
    step = f"step {item['step']:,}" if item.get("step") is not None else "step unknown"
    validated = item.get("val_loss") is not None
    loss = _loss(item.get("val_loss"), column.get("base_val_loss")) if column["strength"] == 1 else \
        NOT_VALIDATED if validated else ""
    lines = [item.get("run") or "", f"{step}, strength {strength_text(column['strength'])}", loss]
    classes = ' class="best"' if best else ""
    star = " &#9733; best" if best else ""
    return (f'<th{classes} title="{escape(item["path"], quote=True)}">{escape(item["label"])}{star}'
            f'{_figures(lines)}</th>')


def _figures(lines: list[str]) -> str:
    return "".join(f'<div class="figures">{escape(line)}</div>' for line in lines if line)


def _loss(value, base) -> str:
    """``val_loss 1.6774 (0.33% below the base)``: the loss and its gain over the base model's."""
    if value is None:
        return ""
    change = f" ({gain_words((base - value) / base)})" if base else ""
    return f"val_loss {value:.5g}{change}"


def summary_lines(best: dict | None, files: list[dict], notes: list[str], strengths: list[float],
                  validated: bool) -> list[str]:
    """The page's first lines: the best file (its loss, gain, step, run and path), the runs the files are of, what
    the validation measured and at which settings."""
    lines = []
    if best:
        gain = f", {gain_words(best['gain'])} ({best['val_loss_base']:.5g})" if best["gain"] is not None else ""
        run = f" of {best['run']}" if best["run"] else ""
        lines.append(f"best: {best['label']}{run} (step {best['step']}): val_loss {best['val_loss']:.5g}{gain}; "
                     f"{best['path']}")
    elif validated:
        lines.append("best: none (no file validated to a finite loss)")
    runs = list(dict.fromkeys(item.get("run") or item.get("run_dir") for item in files if item.get("run_dir")))
    if runs:
        lines.append(f"{'runs' if len(runs) > 1 else 'run'}: {', '.join(runs)}")
    if validated:
        others = [strength_text(strength) for strength in strengths if strength not in (0, 1)]
        lines += [*notes, f"only strength 1 is validated: the {', '.join(others)} columns show clips, not figures"
                  if others else ""]
    return [line for line in lines if line]


def sweep_page(prompts: list, columns: list[dict], cells: dict, best_key: str | None, title: str,
               summary: list[str] = ()) -> str:
    """``columns``: {"file": a file's record or None (base), "strength", ...}; ``cells``: (prompt index, column
    index) -> the clip's path relative to the page, without extension (absent: not rendered); ``summary``: the
    lines above the table."""
    heads = "".join(column_head(column, best_key) for column in columns)
    rows = []
    for index, prompt in enumerate(prompts):
        cells_html = []
        for number, column in enumerate(columns):
            path = cells.get((index, number))
            best = column["file"] is not None and column["file"]["key"] == best_key
            classes = ' class="best"' if best else ""
            if path is None:
                cells_html.append(f'<td{classes}><span class="missing">not rendered</span></td>')
                continue
            source = escape(path, quote=True)
            cells_html.append(f'<td{classes}><video src="{source}.mp4" poster="{source}.png" autoplay loop muted '
                              f'playsinline></video></td>')
        settings = (f"seed {prompt.seed}, {prompt.width}x{prompt.height}x{prompt.num_frames}, {prompt.steps} steps, "
                    f"cfg {prompt.cfg_scale:g}" + (f", first frame {prompt.image}" if prompt.image else ""))
        rows.append(f'<tr><td class="prompt">{escape(prompt.prompt)}<div class="figures">{escape(settings)}</div>'
                    f'</td>{"".join(cells_html)}</tr>')
    top = "".join(f"<div>{escape(line)}</div>" for line in summary)
    return (f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>'
            + (f'<div class="summary">{top}</div>' if top else "")
            + f'<table><tr><th>prompt</th>{heads}</tr>{"".join(rows)}</table></body></html>\n')
