"""Renders a jaxkv.bench.benchmark result (its JSON dict): a markdown report and a tokens/s-vs-context PNG."""

from __future__ import annotations

from absl import logging


def _num(x, fmt: str) -> str:
  return "—" if x is None else format(x, fmt)


def _mib(x) -> str:
  return "—" if x is None else f"{x / 2**20:.1f}"


def _one_device(one: dict | None) -> str:
  if not one or one["status"] != "ok":
    return ""
  return f"; {one['device']} alone: {one['gbps_median']:.1f} GB/s"


def markdown(out: dict) -> str:
  """The report: setup, the per-arm table, then the per-cell ceilings."""
  hw, spec, peak = out["hardware"], out["spec"], out["h2d_peak"]
  m = out["config"]["model"]
  peer = out["peer"]
  lines = [
      "# jaxkv.bench",
      "",
      f"- command: `{out['command']}`",
      f"- hardware: {len(hw['devices'])} x {hw['device_kind']} ({hw['backend']}), jax {hw['jax']}, "
      f"jaxlib {hw['jaxlib']}, tensor axis {out['tensor']}, split mode {out['config']['split']['mode']}",
      f"- model: {m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} heads / {m['num_kv_heads']} "
      f"KV heads x {m['head_dim']}, {m['dtype']}; kv.block {out['config']['kv']['block']}; kv.dtype "
      f"{out['config']['kv'].get('dtype', 'model')} (an arm's _<dtype> suffix overrides it)",
      f"- {spec['new_tokens']} new tokens per sample; {spec['rounds']} rounds in alternating arm order after one "
      "warm-up per arm; median (min–max) of the rounds"
      + (
          "; synthetic context: each prompt's rows below its last prefill chunk are zeros, not prefilled"
          if spec.get("synthetic_context")
          else ""
      ),
      f"- link peak, pinned host -> device `jax.device_put` of {_mib(peak['bytes_per_device'])} MiB per device: "
      f"{peak['gbps_median']:.1f} GB/s per device (median of {len(peak['gbps'])}), "
      f"{out['tensor'] * peak['gbps_median']:.1f} GB/s over the {out['tensor']} devices at once"
      + _one_device(out.get("h2d_peak_one_device")),
      f"- peer arm (Hugging Face offloaded cache): {peer['status']}"
      + (f" — {peer['reason']}" if peer.get("reason") else "")
      + (f" — {peer['note']}" if peer.get("note") else ""),
      "- gain = tok/s over host_d0 (ordered); overlap ratio = ms/step / max(transfer-only, compute-only "
      "(= the device arm)), both of the arm's KV dtype; link efficiency = the arm's stored KV window bytes per "
      "step that the links carry in sequence (split mode tensor: one device's heads; layer: every layer, as the "
      "stages receive in turn) / step time / link peak, where the link peak of a cell is the best of the link "
      "peak put above and the transfer-only steps' rates (one device's link)",
      "- prefill s = time to the first token (median of the rounds; with a synthetic context the jaxkv arms "
      "prefill only the last chunk, the peer the whole prompts)",
      "",
      "| context | batch | arm | KV MiB/step/device | tok/s | ms/step | spread ms (min–max) | prefill s "
      "| gain vs ordered | overlap ratio | link efficiency | ring MiB/device | peak device MiB (process) "
      "| dispatches/step |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for cell in out["cells"]:
    for name, a in cell["arms"].items():
      head = f"| {cell['context']} | {cell['batch']} | {name} | {_mib(a.get('kv_bytes_per_step_per_device'))} |"
      if a["status"] != "ok":
        lines.append(f"{head} skipped: {a['reason']} | | | | | | | | |")
        continue
      ms = a["ms_per_step"]
      lines.append(
          f"{head} {a['tok_s']['median']:.2f} | {ms['median']:.2f} | {ms['min']:.2f}–{ms['max']:.2f} | "
          f"{_num((a.get('prefill_s') or {}).get('median'), '.3f')} | {_num(a['gain_vs_ordered'], '.2f')} | "
          f"{_num(a['overlap_ratio'], '.3f')} | "
          f"{_num(a['link_efficiency'], '.2f')} | {_mib(a['ring_bytes_per_device_configured'])} | "
          f"{_mib(a['device_peak_bytes_in_use_process'])} | "
          f"{_num(a.get('transport', {}).get('dispatches_per_step'), '.1f')} |"
      )
  auto = [(c, n, a) for c in out["cells"] for n, a in c["arms"].items() if a.get("predicted_ms_per_step")]
  if auto:
    lines += [
        "",
        "## Residency planner (auto arms)",
        "",
        "predicted = max(streamed KV bytes / link peak, compute-only), the link's term alone where no device arm "
        "ran; the overlap ratio of an auto arm is "
        "measured / predicted, its link efficiency counts the streamed bytes only.",
        "",
        "| context | batch | arm | resident / streamed layers | device budget MiB | streamed MiB/step/device "
        "| predicted ms | measured ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell, name, a in auto:
      plan = a["transport"]["residency"]
      lines.append(
          f"| {cell['context']} | {cell['batch']} | {name} | {plan['resident_layers']} / {plan['streamed_layers']} "
          f"| {_mib(plan['device_budget_bytes'])} | {_mib(a['streamed_bytes_per_step_per_device'])} "
          f"| {a['predicted_ms_per_step']:.2f} | {_num((a['ms_per_step'] or {}).get('median'), '.2f')} |"
      )
  split = [(c, n, a) for c in out["cells"] for n, a in c["arms"].items() if a.get("delivered_fraction") is not None]
  if split:
    lines += [
        "",
        "## Host attention (_ha arms)",
        "",
        "f = the host's share of the cache's largest window (measured: f* of jaxkv.host.split's model, from the CPU's "
        "and the link's rates measured together and a split layer's fixed cost c, with its predicted gain over "
        "streaming alone and the kernel threads it chose; 'off': host attention turned itself off); x link bound = "
        "tok/s / (batch x link peak / the arm's KV bytes per step): above 1 only because the CPU attends part of the "
        "rows. Thread ms/step, per decode step in the split layers (last sample): the dispatching thread dispatching "
        "the query (with the previous split layer's merge) / the tail's partial (it waits for the tail's delivery) / "
        "waiting for the host's partial / the merges no query carries (the last split layer's, one before a plain "
        "layer or at a stage boundary); the kernel's worker meanwhile waiting for the query / running the kernel and "
        "writing its partial. wait: what waited for the host's partials (kv.host_attention_wait as resolved: thread or"
        " device).",
        "",
        "| context | batch | arm | f (source) | predicted gain | threads | c ms | wait | cpu GB/s "
        "| link GB/s/device | tok/s | ms/step | x link bound "
        "| thread ms/step: query / tail / wait host / merge; worker: wait q / kernel |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, name, a in split:
      ha = a["transport"]["host_attention"]
      lines.append(
          f"| {cell['context']} | {cell['batch']} | {name} | {ha['fraction']:.3f} "
          f"({'off' if ha.get('off') else ha['source']}) | {_num(ha.get('predicted_gain'), '.2f')} | {ha['threads']} "
          f"| {_num(ha.get('fixed_ms'), '.2f')} | {ha.get('wait', '—')} | {_num(ha['cpu_gbps'], '.1f')} "
          f"| {_num(ha['link_gbps'], '.1f')} "
          f"| {_num((a['tok_s'] or {}).get('median'), '.2f')} | {_num((a['ms_per_step'] or {}).get('median'), '.2f')} "
          f"| {_num(a['x_link_bound'], '.2f')} | "
          + " / ".join(_num(ha.get(f"{p}_ms_per_step"), ".2f") for p in ("query", "tail", "wait_host", "merge"))
          + "; "
          + " / ".join(_num(ha.get(f"{p}_ms_per_step"), ".2f") for p in ("wait_query", "kernel"))
          + " |"
      )
  lines += [
      "",
      "## Ceilings per cell",
      "",
      "Compute-only, link peak, link-bound tok/s and token agreement are per cell (link bound: the config's KV "
      "dtype); the other rows hold the transfer ceilings of another KV dtype that a host arm streams.",
      "",
      "| context | batch | kv dtype | window rows | KV MiB/step/device | layer h2d GB/s | transfer-only ms (depth) "
      "| compute-only ms | link peak GB/s | link-bound tok/s | same tokens in the jaxkv arms of each kv dtype |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for cell in out["cells"]:
    rows = [(cell.get("kv_dtype", "model"), cell["ceilings"], cell["kv_bytes_per_step_per_device"], True)]
    rows += [(d, c, c["kv_bytes_per_step_per_device"], False) for d, c in cell.get("ceilings_kv_dtype", {}).items()]
    for kv_dtype, c, step_bytes, first in rows:
      layer = c.get("h2d_layer") or {}
      tr = c.get("transfer_only") or {}
      transfer = f"{tr['ms_median']:.2f} ({tr['depth']})" if tr else f"— {c.get('skipped', '')}"
      per_cell = (
          f"{_num(cell['compute_only_ms'], '.2f')} | {_num(cell.get('link_peak_gbps'), '.1f')} "
          f"| {_num(cell['link_bound_tok_s'], '.2f')} | {cell['tokens_match_across_arms']}"
          if first
          else "| | |"
      )
      lines.append(
          f"| {cell['context']} | {cell['batch']} | {kv_dtype} | {c['window_rows']} | {_mib(step_bytes)} "
          f"| {_num(layer.get('gbps_median'), '.1f')} | {transfer} | {per_cell} |"
      )
  return "\n".join(lines) + "\n"


def plot(out: dict, path: str) -> dict:
  """tokens/s (median) against context, one panel per batch, one line per arm, and the link-bound line.

  Returns {"status": "ok", "path": path} or {"status": "skipped", "reason": ...} (matplotlib missing).
  """
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    logging.warning("no plot: %s (pip install matplotlib)", e)
    return dict(status="skipped", reason=f"matplotlib is not installed: {e}")
  batches = sorted({c["batch"] for c in out["cells"]})
  arms = list(dict.fromkeys(name for c in out["cells"] for name in c["arms"]))
  fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
  for ax, batch in zip(axes[0], batches):
    cells = [c for c in out["cells"] if c["batch"] == batch]
    for name in arms:
      pts = [
          (c["context"], c["arms"][name]["tok_s"]["median"])
          for c in cells
          if name in c["arms"] and c["arms"][name]["tok_s"]
      ]
      if pts:
        ax.plot(*zip(*pts), marker="o", label=name)
    bound = [(c["context"], c["link_bound_tok_s"]) for c in cells if c["link_bound_tok_s"]]
    if bound:
      ax.plot(*zip(*bound), "k--", label="link bound")
    ax.set_xscale("log", base=2)
    ax.set_xticks([c["context"] for c in cells], [str(c["context"]) for c in cells])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"batch {batch}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(f"jaxkv decode, {out['hardware']['device_kind']} x {out['tensor']}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  logging.info("wrote %s", path)
  return dict(status="ok", path=path)
