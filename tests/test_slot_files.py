"""Saved slots (jaxkv.serving.slot_files): a conversation saved, erased and restored continues with the tokens and
logits hash of a server that never saved, its blocks the bits of a cold prefill; the file's checks (another config,
another model's weights, a damaged file, a name escaping the folder); and llama-server's POST /slots/{id} over HTTP
with its errors."""

import dataclasses
import os
import threading

import helpers
import numpy as np
import pytest

from jaxkv import engine as engine_lib
from jaxkv import serving
from jaxkv.serving import slot_files

NEW = 12  # A conversation: a 37-token prompt and 12 tokens, 49 tokens: 3 whole blocks of the tiny config's 16.
TAIL = [5, 6, 7, 8, 9]  # The next turn's tokens.


@pytest.fixture(scope="module")
def engine():
  return helpers.engine(2, placement="host", depth=1)


def _conversation(loop, prompt, max_new_tokens=NEW):
  """Serves one request on the loop; returns its tokens and its cached prompt tokens."""
  done, out = threading.Event(), []
  handle = loop.submit(
      serving.Request(tuple(prompt), max_new_tokens), lambda t, _: out.append(t), lambda *_: done.set()
  )
  assert done.wait(120)
  return out, handle.cached_tokens


@dataclasses.dataclass(frozen=True)
class _Run:
  """A conversation served on slot 0 of a loop (its tokens), saved (the Saved, and its file), erased (the count
  erased: its tokens) and restored; then its next turn there: that request's tokens and cached prompt tokens."""

  conversation: tuple[int, ...]
  saved: slot_files.Saved
  path: str
  erased: int
  next_tokens: list[int]
  next_cached: int


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory) -> _Run:
  loop = serving.ServingLoop(serving.Server(engine, 1, prefix_cache_bytes=2**30), 4).start()
  try:
    prompt = helpers.prompts([37], seed=3)[0]
    tokens, _ = _conversation(loop, prompt)
    conversation = tuple(prompt + tokens)
    assert loop.conversation(0) == conversation
    saved = loop.save(0).result()
    path = str(tmp_path_factory.mktemp("slots") / "chat.bin")
    slot_files.write(path, saved, slot_files.fingerprint(engine.config))
    erased = loop.erase(0).result()
    assert loop.conversation(0) is None
    pc = loop.server.prefix_cache
    assert not any(k in pc for k in pc.keys(conversation, 3))  # The erase dropped its blocks.
    restored = loop.restore(0, slot_files.read(path, slot_files.fingerprint(engine.config), 16)[0], "chat.bin")
    assert restored.result() == conversation and loop.conversation(0) == conversation
    after = _conversation(loop, conversation + tuple(TAIL), 6)
  finally:
    loop.stop(60)
  return _Run(conversation, saved, path, erased, *after)


def test_save_reads_the_conversation_s_whole_blocks_with_a_cold_prefill_s_bits(engine, saved):
  conversation, s = saved.conversation, saved.saved
  assert s.tokens == conversation and saved.erased == len(conversation) == 37 + NEW
  assert len(s.blocks) == 3 and len(s.blocks[0]) == engine.config.model.num_layers
  # A server that prefilled the next turn cold stored the same blocks (the third holds generated tokens: Save
  # prefilled it alone).
  cold = serving.Server(engine, 1, prefix_cache_bytes=2**30)
  cold.serve([serving.Request(conversation + tuple(TAIL), 2)])
  for i, key in enumerate(cold.prefix_cache.keys(conversation, 3)):
    for mine, want in zip(s.blocks[i], cold.prefix_cache.entry(key).rows):
      np.testing.assert_array_equal(mine, np.asarray(want))


def test_restored_continues_as_if_never_saved(engine, saved):
  conversation, path = saved.conversation, saved.path
  request = serving.Request(conversation + tuple(TAIL), 6)
  want = serving.Server(engine, 1, prefix_cache_bytes=1).serve([request]).results[0]  # Never saved, nothing cached.
  assert saved.next_tokens == want.tokens and saved.next_cached == 48  # The loop's restored slot: 3 blocks.
  fresh = serving.Server(engine, 2, prefix_cache_bytes=2**30)  # Another server, restored from the file.
  fp = slot_files.fingerprint(engine.config)
  assert fresh.work(slot_files.Restore(slot_files.read(path, fp, 16)[0], "chat.bin")) == conversation
  out = fresh.serve([request])
  assert (out.results[0].tokens, out.results[0].logits_sha256) == (want.tokens, want.logits_sha256)
  assert out.transport["prefix_cache"]["hit_tokens"] == 48


def test_the_file_is_refused_by_another_config_or_model(engine, saved):
  path, s = saved.path, saved.saved
  other = helpers.engine(2, placement="host", depth=1, chunk=32)
  with pytest.raises(ValueError, match="saved by another model or config"):
    slot_files.read(path, slot_files.fingerprint(other.config), 32)
  # The same config with other weights: block 0's bits differ.
  reseeded = engine_lib.Engine(engine.config, helpers.mesh(2), helpers.params(2, 1, engine.config.model))
  server = serving.Server(reseeded, 1, prefix_cache_bytes=2**30)
  with pytest.raises(ValueError, match="this model does not compute"):
    server.work(slot_files.Restore(s, "chat.bin"))
  assert server.prefix_cache.summary()["entries"] == 1  # Only its own block 0.
  with pytest.raises(ValueError, match="needs the prefix cache"):
    serving.Server(engine, 1).work(slot_files.Restore(s, "chat.bin"))
  with pytest.raises(ValueError, match="raise --prefix_cache_gib"):
    serving.Server(engine, 1, prefix_cache_bytes=2**16).work(slot_files.Restore(s, "chat.bin"))


def test_a_damaged_file_or_a_name_outside_the_folder_is_refused(engine, tmp_path):
  fp = slot_files.fingerprint(engine.config)
  for name in ("", ".", "..", "../x.bin", "a/b.bin", "a\\b.bin"):
    with pytest.raises(ValueError, match="not a plain file name"):
      slot_files.path_in(str(tmp_path), name)
  assert slot_files.path_in(str(tmp_path), "x.bin") == os.path.join(str(tmp_path), "x.bin")
  (tmp_path / "junk.bin").write_bytes(b"not a slot file")
  with pytest.raises(ValueError, match="not a jaxkv slot file"):
    slot_files.read(str(tmp_path / "junk.bin"), fp, 16)
  short = slot_files.Saved(tuple(range(20)), [[np.zeros((2, 1, 8, 8, 16), np.float32)] * 6])  # 8 rows, not 16.
  slot_files.write(str(tmp_path / "short.bin"), short, fp)
  with pytest.raises(ValueError, match="damaged"):
    slot_files.read(str(tmp_path / "short.bin"), fp, 16)
  with pytest.raises(FileNotFoundError):
    slot_files.read(str(tmp_path / "none.bin"), fp, 16)


def test_a_save_while_another_request_decodes_runs_between_its_steps(engine, saved):
  conversation, s = saved.conversation, saved.saved
  loop = serving.ServingLoop(serving.Server(engine, 1, prefix_cache_bytes=2**30), 4).start()
  try:
    _conversation(loop, conversation[:37])  # Slot 0 serves the conversation again (greedy: the same tokens).
    assert loop.conversation(0) == conversation
    long = serving.Request(tuple(helpers.prompts([20], seed=5)[0]), 24)  # Slot 0's next request.
    tokens, futures, done = [], [], threading.Event()

    def on_token(token, _):  # On the engine thread: slot 0's conversation saved while its next request decodes.
      tokens.append(token)
      if len(tokens) == 3:
        futures.append(loop.save(0))

    def on_end(*_):
      futures.append(futures[0].done())
      done.set()

    loop.submit(long, on_token, on_end)
    assert done.wait(120)
  finally:
    loop.stop(60)
  assert futures[1]  # Done before the request's last token: its blocks were read between the request's steps.
  for mine, want in zip(futures[0].result().blocks, s.blocks):
    for a, b in zip(mine, want):
      np.testing.assert_array_equal(a, b)
  assert tokens == serving.Server(engine, 1).serve([long]).results[0].tokens  # Its neighbour changed no token.


def test_slots_over_http_save_erase_restore_and_continue(engine, saved, tmp_path):
  for extra in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(extra, reason="the serve extra: pip install -e '.[serve]'")
  import httpx  # pylint: disable=g-import-not-at-top
  import serve_helpers  # pylint: disable=g-import-not-at-top

  conversation, want = saved.conversation, saved.next_tokens
  prompt = list(conversation[:37])
  with serve_helpers.running(engine, parallel=1, prefix_cache_bytes=2**30, slot_save_path=str(tmp_path)) as (url, _):
    post = lambda path, **body: httpx.post(url + path, timeout=120, **body)
    out = post("/v1/completions", json=dict(prompt=prompt, max_tokens=NEW)).json()
    assert prompt + out["choices"][0]["token_ids"] == list(conversation)
    answer = post("/slots/0?action=save", json={"filename": "c.bin"}).json()
    assert answer["id_slot"] == 0 and answer["filename"] == "c.bin" and answer["n_saved"] == len(conversation)
    assert answer["n_written"] == os.path.getsize(tmp_path / "c.bin") and answer["timings"]["save_ms"] > 0
    assert post("/slots/0?action=erase").json() == {"id_slot": 0, "n_erased": len(conversation)}
    restored = post("/slots/0?action=restore", json={"filename": "c.bin"}).json()
    assert restored["n_restored"] == len(conversation) and restored["n_read"] == answer["n_written"]
    out = post("/v1/completions", json=dict(prompt=list(conversation) + TAIL, max_tokens=6)).json()
    assert out["choices"][0]["token_ids"] == want and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    slot_files.write(str(tmp_path / "other.bin"), slot_files.Saved((1,), []), "another model's")
    errors = [
        (post("/slots/0?action=bogus"), "action: 'bogus' is none of save, restore, erase"),
        (post("/slots/1?action=erase"), "no slot '1'; the server has slots 0..0"),
        (post("/slots/x?action=erase"), "no slot 'x'"),
        (post("/slots/0?action=save", json={"filename": "../c.bin"}), "is not a plain file name"),
        (post("/slots/0?action=restore", json={"filename": "none.bin"}), "no file 'none.bin'"),
        (post("/slots/0?action=restore", json={"filename": "other.bin"}), "saved by another model or config"),
        (post("/slots/0?action=save"), 'save needs a body {"filename": ...}'),
        (post("/slots/0?action=save", json={"file": "c.bin"}), "unsupported field 'file'"),
    ]
    for response, message in errors:
      assert response.status_code == 400, response.text
      assert message in response.json()["error"]["message"], (message, response.text)
    assert not os.path.exists(tmp_path.parent / "c.bin")
    assert post("/slots/0?action=erase").json()["n_erased"] == len(conversation) + 6 + 5  # The last request's.
    response = post("/slots/0?action=save", json={"filename": "c.bin"})
    assert response.status_code == 400 and "slot 0 holds no conversation" in response.json()["error"]["message"]
  with serve_helpers.running(engine, parallel=1, slot_save_path=str(tmp_path)) as (url, _):
    response = httpx.post(url + "/slots/0?action=restore", json={"filename": "c.bin"}, timeout=120)
    assert response.status_code == 400 and "start the server with --prefix_cache_gib" in response.text
  with serve_helpers.running(engine, parallel=1, prefix_cache_bytes=2**30) as (url, _):
    response = httpx.post(url + "/slots/0?action=save", json={"filename": "c.bin"}, timeout=120)
    assert response.status_code == 501 and "start it with --slot_save_path" in response.json()["error"]["message"]


def test_a_conversation_shorter_than_a_block_keeps_its_tokens_only(engine, tmp_path):
  server, fp = serving.Server(engine, 1, prefix_cache_bytes=2**30), slot_files.fingerprint(engine.config)
  short = server.work(slot_files.Save(range(15)))  # 15 tokens: no whole block of 16.
  assert short == slot_files.Saved(tuple(range(15)), [])
  slot_files.write(str(tmp_path / "short.bin"), short, fp)
  saved, _ = slot_files.read(str(tmp_path / "short.bin"), fp, 16)
  assert saved == short and server.work(slot_files.Restore(saved, "short.bin")) == tuple(range(15))
  assert len(server.prefix_cache) == 0
