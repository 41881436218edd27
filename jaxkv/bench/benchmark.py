"""The decode benchmark behind `python -m jaxkv.bench`: arms x contexts x batches in alternating rounds.

The arms are those of jaxkv.bench.arms and the Hugging Face peer (PEER_ARM, jaxkv.bench.peer_hf). Every jaxkv arm
shares one set of weights. For each (context, batch) cell: the ceilings (jaxkv.bench.ceilings) for the config's KV
dtype and for every other KV dtype of a host arm, then one untimed warm-up generate per arm (it also compiles), then
`rounds` timed generates per arm in alternating order (round 0 A B C, round 1 C B A, ...).
A sample is one generate of `new_tokens` tokens from `batch` random prompts of `context` tokens (with
synthetic_context, all but the last prefill chunk of each stored as zeros, not prefilled):
ms/step = 1e3 * decode_s / decode_steps, tok/s = batch * decode_steps / decode_s; prefill_s is the time to the first
token (the peer's too: its prefill of the whole prompts).

An arm that does not fit (pinned pool ValueError, XLA RESOURCE_EXHAUSTED / out of memory, or a peer that
cannot run) is reported skipped with its reason, from then on in that cell.

Units: s in raw samples, ms and tok/s in stats, GB/s = 1e9 B/s (one device's link), bytes "per device" = the
fullest device's share (its KV heads; in split mode layer, its layers). The link bound and link efficiency use
the bytes the links carry in sequence (kv_step_bytes). `peak_bytes_in_use` from memory_stats() is process-wide
since start: a later arm inherits earlier peaks. KV bytes are the stored bytes (a quantized row's packed values and
scales): each arm's link efficiency and transfer-only bound use its own KV dtype's bytes and ceilings. The JSON is
rewritten after every cell ("complete": false until the last), so a run cut short keeps its finished cells.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import os
import platform
import statistics
from collections.abc import Callable

import jax
import jaxlib
import tqdm
from absl import logging

from jaxkv import cache as cache_lib
from jaxkv import distributed
from jaxkv import mesh as mesh_lib
from jaxkv import residency
from jaxkv import run as run_lib
from jaxkv import speculate
from jaxkv.bench import ceilings
from jaxkv.bench import peer_hf
from jaxkv.bench import report
from jaxkv.bench.arms import DEVICE_ARM, ORDERED_ARM, PEER_ARM, arm_config, arm_kv_dtype, parse_arm
from jaxkv.config import Config, ModelConfig
from jaxkv.engine import Engine

_TRANSFER_ONLY_PASSES = 8


@dataclasses.dataclass(frozen=True)
class BenchSpec:
  """contexts: prompt tokens per sequence; batches: sequences; arms: "device" or "host_d<depth>", each with an
  optional "_<kv dtype>" suffix;
  new_tokens: tokens generated per sequence (>= 2; decode steps = new_tokens - 1); rounds: timed samples per
  arm and cell; peer: add PEER_ARM; peak_bytes: per-device size of the link peak transfer (0 = sized to the run,
  link_test_bytes); ceiling_reps: samples per ceiling; synthetic_context: the jaxkv arms store each prompt's rows
  below its last prefill chunk as zeros instead of prefilling them (Engine.generate's zero_rows; the peer prefills
  in full): the same decode work for a fraction of the prefill time, with other tokens than a full prefill's;
  ceilings: measure the link and transfer-only ceilings of each cell (each fills a whole host cache)."""

  contexts: tuple[int, ...]
  batches: tuple[int, ...]
  arms: tuple[str, ...]
  new_tokens: int
  rounds: int
  peer: bool
  seed: int = 0
  peak_bytes: int = 2**30
  ceiling_reps: int = 5
  synthetic_context: bool = False
  ceilings: bool = True

  def __post_init__(self):
    if not self.contexts or min(self.contexts) < 1 or not self.batches or min(self.batches) < 1:
      raise ValueError(f"contexts and batches must be positive, got {self.contexts} and {self.batches}")
    if not self.arms or len(set(self.arms)) != len(self.arms):
      raise ValueError(f"arms must be distinct and not empty, got {self.arms}")
    for a in self.arms:
      parse_arm(a)
    if self.new_tokens < 2:
      raise ValueError(f"new_tokens must be >= 2 (one decode step at least), got {self.new_tokens}")
    if self.rounds < 1 or self.ceiling_reps < 1 or self.peak_bytes < 0:
      raise ValueError("rounds and ceiling_reps must be positive, peak_bytes >= 0 (0 = sized to the run)")


def kv_step_bytes(config: Config, layout, batch: int, rows: list[int]) -> dict:
  """Stored KV bytes delivered per decode step (mean over the steps' windows), in config.kv.dtype:

  per_device: what the fullest device receives;
  in_sequence: what the links carry one layer after another, each layer's per-device share summed over the
    layers (split mode tensor: = per_device, every device receives its heads of each layer at once; split mode
    layer: every layer's bytes, the stages receive in turn);
  total: over all devices.
  """
  m = config.model
  row_bytes = cache_lib.row_bytes(m, config.kv.dtype, batch)  # One row, all heads.
  per_row = collections.Counter()
  in_sequence = 0
  for l in range(m.num_layers):
    devices = list(layout.mesh(l).devices.flat)
    share = row_bytes // len(devices)
    for d in devices:
      per_row[d] += share
    in_sequence += share
  mean_rows = statistics.mean(rows)
  return dict(
      per_device=max(per_row.values()) * mean_rows,
      in_sequence=in_sequence * mean_rows,
      total=m.num_layers * row_bytes * mean_rows,
  )


def cell_config(config: Config, context: int, new_tokens: int) -> Config:
  """engine.capacity = context + new_tokens rounded up to a kv.block (prefill_chunk is left as configured)."""
  block = config.kv.block
  cap = -(-(context + new_tokens) // block) * block
  return dataclasses.replace(config, engine=dataclasses.replace(config.engine, capacity=cap))


def decode_window_rows(context: int, decode_steps: int, block: int) -> list[int]:
  """Rows of the window delivered at decode steps 1..decode_steps (full blocks below the row written)."""
  return [(context + t - 1) // block * block for t in range(1, decode_steps + 1)]


def skip_reason(e: Exception) -> str | None:
  """The reason to report an arm skipped for this error, or None when it is a bug to raise."""
  msg = str(e)
  fits = isinstance(e, ValueError) and "pinned" in msg
  oom = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
  if fits or oom or isinstance(e, peer_hf.PeerError):
    return f"{type(e).__name__}: {msg[:800]}"
  return None


def _stats(values: list[float]) -> dict | None:
  return dict(median=statistics.median(values), min=min(values), max=max(values)) if values else None


def fullest_device_stats(mesh: jax.sharding.Mesh) -> dict | None:
  """memory_stats() of the mesh's local device with the most bytes in use, or None where there are no stats."""
  stats = [d.memory_stats() for d in mesh.local_devices]
  return None if None in stats else max(stats, key=lambda m: m.get("bytes_in_use", 0))


def hardware() -> dict:
  return dict(
      devices=[str(d) for d in jax.devices()],
      device_kind=jax.devices()[0].device_kind,
      backend=jax.default_backend(),
      processes=jax.process_count(),
      jax=jax.__version__,
      jaxlib=jaxlib.__version__,
      python=platform.python_version(),
      host=platform.node(),
  )


class _Arm:
  """One arm in one cell: run_once() -> a sample dict (decode_s, decode_steps, ...; "transport" is kept apart),
  and the record that goes to the JSON: status, reason, warmup, samples, transport."""

  def __init__(self, name: str, run_once: Callable[[], dict] | None, reason: str | None = None):
    self.name, self.run_once = name, run_once
    self.rec: dict = dict(status="ok" if reason is None else "skipped", reason=reason, samples=[])

  def attempt(self, label: str, batch: int, mesh) -> dict | None:
    """Runs one generate; on an error that means "does not fit" marks the arm skipped and returns None."""
    if self.rec["status"] != "ok":
      return None
    try:
      s = self.run_once()
    except Exception as e:  # pylint: disable=broad-except  (re-raised unless it means "does not fit")
      reason = skip_reason(e)
      if reason is None:
        raise
      # The fullest device's allocator when it failed (the failed call's arrays are still referenced here): what
      # filled it, its limit and its largest free block (fragmentation).
      self.rec.update(status="skipped", reason=f"{label}: {reason}", device_memory_at_skip=fullest_device_stats(mesh))
      logging.warning("arm %s skipped at %s: %s", self.name, label, reason)
      return None
    finally:
      gc.collect()
    if "transport" in s:
      self.rec["transport"] = s.pop("transport")
    s.update(
        ms_per_step=1e3 * s["decode_s"] / s["decode_steps"],
        tok_s=batch * s["decode_steps"] / s["decode_s"],
        device_peak_bytes_in_use_process=distributed.device_stat(mesh),
    )
    return s


def _jax_runner(
    engine: Engine, prompts, new_tokens: int, seed: int, zero_rows: int, right: int | None = None
) -> Callable[[], dict]:
  """A run of the arm's engine; with `right`, speculative with an oracle drafter of that many right tokens, whose
  truth is a plain run's tokens (run once, untimed)."""
  truth = []

  def run_once():
    drafter = None
    if right is not None:
      if not truth:
        truth.append(engine.generate(prompts, new_tokens, seed=seed, zero_rows=zero_rows).tokens)
      drafter = speculate.Oracle(truth[0], [len(p) for p in prompts], right, engine.config.model.vocab_size)
    res = engine.generate(prompts, new_tokens, seed=seed, zero_rows=zero_rows, drafter=drafter)
    transport = {k: v for k, v in res.transport.items() if k not in ("steps", "layer_times_ms")}
    return dict(res.timing, tokens_sha256=res.tokens_sha256, transport=transport)

  return run_once


def _run_cell(
    config: Config, mesh, params, peer, peer_reason, spec: BenchSpec, context: int, batch: int, peak_gbps: float
) -> dict:
  cfg = cell_config(config, context, spec.new_tokens)
  steps = spec.new_tokens - 1
  rows = decode_window_rows(context, steps, cfg.kv.block)
  layout = run_lib.make_layout(cfg, mesh)
  cell = dict(
      context=context,
      batch=batch,
      capacity=cfg.engine.capacity,
      decode_window_rows=rows,
      kv_dtype=cfg.kv.dtype,
      **_bytes_fields(cfg, layout, batch, rows),
  )
  # Ceilings for the config's KV dtype, then for every other KV dtype that a host arm streams.
  other = [
      d
      for d in dict.fromkeys(arm_kv_dtype(cfg, a) for a in spec.arms if not a.startswith(DEVICE_ARM))
      if d != cfg.kv.dtype
  ]
  cell["ceilings"] = _ceilings(cfg, mesh, batch, rows[0], spec, layout)
  cell["ceilings_kv_dtype"] = {}
  for kv_dtype in other:
    dcfg = dataclasses.replace(cfg, kv=dataclasses.replace(cfg.kv, dtype=kv_dtype))
    cell["ceilings_kv_dtype"][kv_dtype] = dict(
        _ceilings(dcfg, mesh, batch, rows[0], spec, layout),
        **_bytes_fields(dcfg, layout, batch, rows),
    )

  prompts = run_lib.random_prompts(cfg.model.vocab_size, [context] * batch, spec.seed + context + batch)
  chunk = cfg.engine.prefill_chunk
  zero_rows = (context - 1) // chunk * chunk if spec.synthetic_context else 0  # All chunks but the last.
  arms = [
      _Arm(
          name,
          _jax_runner(
              Engine(arm_config(cfg, name), mesh, params, layout),
              prompts,
              spec.new_tokens,
              spec.seed,
              zero_rows,
              parse_arm(name).right,
          ),
      )
      for name in spec.arms
  ]
  if spec.peer:
    run_peer = None if peer is None else lambda: peer.generate(prompts, spec.new_tokens)
    arms.append(_Arm(PEER_ARM, run_peer, peer_reason))

  for arm in arms:
    logging.info("context %d batch %d: warm-up %s", context, batch, arm.name)
    arm.rec["warmup"] = arm.attempt("warm-up", batch, mesh)
  order = []
  for r in range(spec.rounds):
    names = arms if r % 2 == 0 else arms[::-1]
    order.append([a.name for a in names])
    for arm in names:
      s = arm.attempt(f"round {r}", batch, mesh)
      if s is not None:
        arm.rec["samples"].append(dict(s, round=r))
        logging.info(
            "context %d batch %d round %d/%d %s: %.2f ms/step, %.1f tok/s",
            context,
            batch,
            r + 1,
            spec.rounds,
            arm.name,
            s["ms_per_step"],
            s["tok_s"],
        )
  cell["order"] = order
  cell["arms"] = {a.name: a.rec for a in arms}
  for name, rec in cell["arms"].items():
    # The peer keeps its cache in the model dtype.
    kv = dataclasses.replace(cfg.kv, dtype="model") if name == PEER_ARM else arm_config(cfg, name).kv
    acfg = dataclasses.replace(cfg, kv=kv)
    rec.update(kv_dtype=kv.dtype, **_bytes_fields(acfg, layout, batch, rows))
  cell["h2d_chunked"] = _chunked_links(cfg.model, mesh, batch, rows[0], spec.ceiling_reps, cell["arms"])
  _summarize(cell, peak_gbps)
  return cell


def _bytes_fields(cfg: Config, layout, batch: int, rows: list[int]) -> dict:
  b = kv_step_bytes(cfg, layout, batch, rows)
  return dict(
      kv_bytes_per_step_per_device=b["per_device"],
      kv_bytes_per_step_in_sequence=b["in_sequence"],
      kv_bytes_per_step_total=b["total"],
  )


def _ceilings(cfg: Config, mesh, batch: int, rows: int, spec: BenchSpec, layout) -> dict:
  """jaxkv.bench.ceilings.cell_ceilings at the first decode step's window (new_tokens < kv.block keeps it for every
  step), in cfg.kv.dtype; a ceiling that does not fit, or not asked for (spec.ceilings), is reported skipped."""
  if not spec.ceilings:
    return dict(window_rows=rows, skipped="not measured (--noceilings)")
  logging.info("ceilings, kv dtype %s", cfg.kv.dtype)
  try:
    out = ceilings.cell_ceilings(cfg, mesh, batch, rows, spec.ceiling_reps, _TRANSFER_ONLY_PASSES, layout)
  except Exception as e:  # pylint: disable=broad-except  (re-raised unless it means "does not fit")
    reason = skip_reason(e)
    if reason is None:
      raise
    out = dict(window_rows=rows, skipped=reason)
  gc.collect()
  return out


def _chunked_links(model: ModelConfig, mesh, batch: int, rows: int, reps: int, arms: dict) -> dict:
  """Per auto arm that streams windows of `rows` rows in chunks: jaxkv.bench.ceilings.h2d_chunked at its KV dtype
  and chunk rows (each pair measured once), or why it was skipped."""
  out, seen = {}, {}
  for name, rec in arms.items():
    transport = rec.get("transport") or {}
    c_rows, plan = transport.get("delivery_chunk_rows"), transport.get("residency")
    if rec["status"] != "ok" or not c_rows or not (plan and plan["streamed_layers"]) or rows <= c_rows:
      continue
    key = (rec["kv_dtype"], c_rows)
    if key not in seen:
      try:
        seen[key] = ceilings.h2d_chunked(model, rec["kv_dtype"], mesh, batch, rows, c_rows, reps)
      except Exception as e:  # pylint: disable=broad-except  (re-raised unless it means "does not fit")
        reason = skip_reason(e)
        if reason is None:
          raise
        seen[key] = dict(skipped=reason)
      gc.collect()
    out[name] = seen[key]
  return out


def _transfer_ms(ceil: dict) -> float | None:
  return (ceil.get("transfer_only") or {}).get("ms_median")


def _summarize(cell: dict, peak_gbps: float) -> None:
  """Adds per-arm stats, gain vs ordered, overlap ratio and link efficiency to a finished cell.

  Per KV dtype: the transfer-only ceiling of that dtype, and the compute-only time of the device arm of that
  dtype (else the plain device arm).
  """
  arms = cell["arms"]
  for rec in arms.values():
    ok = rec["status"] == "ok"
    rec["ms_per_step"] = _stats([s["ms_per_step"] for s in rec["samples"]]) if ok else None
    rec["tok_s"] = _stats([s["tok_s"] for s in rec["samples"]]) if ok else None
    rec["prefill_s"] = _stats([s["prefill_s"] for s in rec["samples"]]) if ok else None  # Time to first token.
    warm = rec.get("warmup") or {}
    rec["device_peak_bytes_in_use_process"] = warm.get("device_peak_bytes_in_use_process")

  def med(name, key):
    stats = arms[name][key] if name in arms else None
    return stats and stats["median"]

  ordered_tok_s = med(ORDERED_ARM, "tok_s")
  base = cell["kv_dtype"]
  # Per KV dtype: (the fullest device's stored bytes per step, transfer-only ms); the config's dtype first.
  per_dtype = {base: (cell["kv_bytes_per_step_per_device"], _transfer_ms(cell["ceilings"]))}
  for d, c in cell["ceilings_kv_dtype"].items():
    per_dtype[d] = (c["kv_bytes_per_step_per_device"], _transfer_ms(c))
  cell["compute_only_ms"] = med(DEVICE_ARM, "ms_per_step")
  cell["transfer_only_ms"] = per_dtype[base][1]
  # Back-to-back layer deliveries can beat one large put: the link peak (one device's link) is the best of the
  # put and the transfer-only streaming rates (the fullest device's bytes; in split mode layer the stages receive
  # mostly in turn, so that rate is below one link's and the put decides).
  streaming = [b / (ms * 1e-3) / 1e9 for b, ms in per_dtype.values() if b and ms]
  peak_gbps = max([peak_gbps, *streaming])
  step_bytes = cell["kv_bytes_per_step_in_sequence"]
  cell["link_peak_gbps"] = peak_gbps
  cell["link_bound_tok_s"] = cell["batch"] * peak_gbps * 1e9 / step_bytes if step_bytes else None
  for name, rec in arms.items():
    ms, tok_s = med(name, "ms_per_step"), med(name, "tok_s")
    kv_dtype = rec["kv_dtype"]
    transfer_ms = per_dtype.get(kv_dtype, per_dtype[base])[1]
    compute_ms = med(f"{DEVICE_ARM}_{kv_dtype}", "ms_per_step") or cell["compute_only_ms"]
    bound_ms = max([m for m in (compute_ms, transfer_ms) if m], default=None)
    # The peer moves every byte over one device's link.
    moved = rec["kv_bytes_per_step_total" if name == PEER_ARM else "kv_bytes_per_step_in_sequence"]
    arm = None if name == PEER_ARM else parse_arm(name)
    is_device = arm is not None and arm.placement == "device"
    rec["gain_vs_ordered"] = tok_s / ordered_tok_s if tok_s and ordered_tok_s else None
    rec["overlap_ratio"] = ms / bound_ms if ms and bound_ms else None
    rec["link_efficiency"] = moved / (ms * 1e-3) / (peak_gbps * 1e9) if ms and not is_device else None
    rec["ring_bytes_per_device_configured"] = rec.get("transport", {}).get("ring_bytes_per_device_configured")
    kv_bytes = rec["kv_bytes_per_step_in_sequence"]
    rec["link_bound_tok_s"] = cell["batch"] * peak_gbps * 1e9 / kv_bytes if kv_bytes else None
    bound = rec["link_bound_tok_s"]
    rec["x_link_bound"] = tok_s / bound if tok_s and bound and not is_device else None
    plan = rec.get("transport", {}).get("residency")
    if plan and (compute_ms or plan["streamed_layers"]):  # Residency planner: the streamed share of the KV against
      # the model; without a device arm to time the compute (it did not run, or does not fit) the link's term alone,
      # at the rate of the deliveries it makes (chunks, where it chunks).
      share = plan["streamed_layers"] / (plan["streamed_layers"] + plan["resident_layers"])
      link = (cell.get("h2d_chunked", {}).get(name) or {}).get("gbps_median") or peak_gbps
      rec["streamed_bytes_per_step_per_device"] = share * rec["kv_bytes_per_step_per_device"]
      rec["predicted_compute_ms"] = compute_ms
      rec["predicted_link_gbps"] = link
      rec["predicted_ms_per_step"] = residency.predict_step_ms(
          rec["streamed_bytes_per_step_per_device"], link, compute_ms or 0.0
      )
      if ms:
        rec["overlap_ratio"] = ms / rec["predicted_ms_per_step"]
        rec["link_efficiency"] = rec["streamed_bytes_per_step_per_device"] / (ms * 1e-3) / (peak_gbps * 1e9)
    split = rec.get("transport", {}).get("host_attention")
    if split:  # Host attention: the link moves (1 - f) of the streamed bytes (a little more: r1 rounds down to a
      # block); no plain overlap bound applies.
      rec["delivered_fraction"] = 1 - split["fraction"]
      rec["overlap_ratio"] = None
      rec["link_efficiency"] = (1 - split["fraction"]) * rec["link_efficiency"] if rec["link_efficiency"] else None
  # Arms of one KV dtype must agree bit for bit; arms of different KV dtypes may differ, and so may host attention
  # arms (another summation order: docs/design.md).
  hashes: dict[str, set] = {}
  for n, r in arms.items():
    if n != PEER_ARM and parse_arm(n).host_attention is None:
      hashes.setdefault(r["kv_dtype"], set()).update(s["tokens_sha256"] for s in r["samples"])
  seen = [h for h in hashes.values() if h]
  cell["tokens_match_across_arms"] = all(len(h) == 1 for h in seen) if seen else None


def _one_device_peak(mesh, spec: BenchSpec) -> dict:
  """The link peak of the mesh's first device alone, beside h2d_peak (every device at once): whether the host
  limits the aggregate."""
  if mesh.size == 1:
    return dict(status="skipped", reason="one device: h2d_peak is that device alone")
  if jax.process_count() > 1:
    return dict(status="skipped", reason=f"{jax.process_count()} processes: measured on one process only")
  one = mesh_lib.make_mesh(devices=mesh.devices.flat[:1])
  return dict(
      status="ok", device=str(one.devices.flat[0]), **ceilings.h2d_peak(one, spec.peak_bytes, spec.ceiling_reps)
  )


def _start_peer(config: Config, spec: BenchSpec):
  """(peer or None, status dict). The peer runs only beside a JAX GPU run."""
  if not spec.peer:
    return None, dict(status="off")
  if jax.default_backend() != "gpu":
    reason = f"jax runs on {jax.default_backend()}: the peer is compared on GPU only"
    return None, dict(status="skipped", reason=reason)
  if jax.process_count() > 1:
    return None, dict(status="skipped", reason=f"{jax.process_count()} processes: the peer runs on one host only")
  try:
    peer = peer_hf.HFPeer.start(config.model, max(spec.contexts) + spec.new_tokens + config.kv.block)
  except peer_hf.PeerError as e:
    return None, dict(status="skipped", reason=str(e))
  return peer, dict(
      status="ok", info=peer.info, note="interleaved in the rounds like the other arms; runs in a worker process"
  )


def run(
    config: Config,
    spec: BenchSpec,
    command: str = "",
    json_out: str | None = None,
    md_out: str | None = None,
    plot_out: str | None = None,
) -> dict:
  """Runs the benchmark; writes the JSON / markdown / PNG outputs that are asked for; returns the JSON dict."""
  for arm in spec.arms:  # A KV dtype that does not fit the model fails here, before any work.
    arm_config(config, arm)
  mesh, params, _ = run_lib.build(config, spec.seed)
  if not spec.peak_bytes:
    spec = dataclasses.replace(spec, peak_bytes=link_test_bytes(config, mesh, spec))
  out = dict(
      command=command,
      hardware=hardware(),
      config=dataclasses.asdict(config),
      spec=dataclasses.asdict(spec),
      tensor=mesh_lib.tensor_size(mesh),
  )
  logging.info("link peak: %d B per device, %d puts", spec.peak_bytes, spec.ceiling_reps)
  peak = ceilings.h2d_peak(mesh, spec.peak_bytes, spec.ceiling_reps)
  out["h2d_peak"] = peak
  out["h2d_peak_one_device"] = _one_device_peak(mesh, spec)
  peer, out["peer"] = _start_peer(config, spec)
  out.update(complete=False, cells=[])
  cells = [(context, batch) for context in spec.contexts for batch in spec.batches]
  progress = tqdm.tqdm(total=len(cells), desc="bench cells", unit="cell", delay=5, disable=not distributed.is_main())
  try:
    for context, batch in cells:
      progress.set_postfix(context=context, batch=batch)
      cell = _run_cell(config, mesh, params, peer, out["peer"].get("reason"), spec, context, batch, peak["gbps_median"])
      out["cells"].append(cell)
      progress.update()
      if json_out:
        _write_json(out, json_out)
  finally:
    progress.close()
    if peer is not None:
      peer.close()
  out["complete"] = True
  if plot_out:
    out["plot"] = report.plot(out, plot_out)
  if md_out:
    with open(md_out, "w") as f:
      f.write(report.markdown(out))
    logging.info("wrote %s", md_out)
  if json_out:
    _write_json(out, json_out)
    logging.info("wrote %s", json_out)
  return out


LINK_TEST_BYTES = (2**20, 2**30)  # The bounds of the link test sized to the run, per device.


def link_test_bytes(config: Config, mesh, spec: BenchSpec) -> int:
  """The link test's size per device sized to the run: the most KV bytes a device receives in one decode step of
  the largest cell (as if every layer were streamed), within LINK_TEST_BYTES."""
  context, batch = max(spec.contexts), max(spec.batches)
  cfg = cell_config(config, context, spec.new_tokens)
  rows = decode_window_rows(context, spec.new_tokens - 1, cfg.kv.block)
  step = kv_step_bytes(cfg, run_lib.make_layout(cfg, mesh), batch, rows[-1:])["per_device"]
  return int(min(max(step, LINK_TEST_BYTES[0]), LINK_TEST_BYTES[1]))


def _write_json(out: dict, path: str) -> None:
  with open(path + ".tmp", "w") as f:
    json.dump(out, f, indent=1)
  os.replace(path + ".tmp", path)
