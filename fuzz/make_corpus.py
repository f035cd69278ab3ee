#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/corpus/<harness>/ (docs/fuzzing.md): a few valid inputs
per harness and near-valid ones that each break one rule; and fuzz/regressions/<harness>/,
the findings recorded in docs/fuzzing.md (inputs that crashed a harness), to rerun by hand. Deterministic; rerun after
changing it and commit the result. The checkpoint seeds follow docs/checkpoint_format.md
byte for byte, checksums included, so the fuzzer starts from files the reader accepts."""

import json
import os
import shutil
import struct

ROOT = os.path.dirname(os.path.abspath(__file__))


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283


def hex32(v):
    return "0x%08x" % v


def write_corpus(harness, inputs, kind="corpus"):
    d = os.path.join(ROOT, kind, harness)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for name, data in inputs.items():
        if isinstance(data, str):
            data = data.encode()
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


# --- inject_spec: SINEW_INJECT values (runtime/failure_injection.h).
write_corpus("inject_spec", {
    "kill": "kill:worker=2:step=30:phase=backward",
    "stop": "stop:worker=1:step=50:secs=3",
    "mute": "mute:worker=1:step=20:secs=3",
    "slow_every_step": "slow:worker=0:ms=20",
    "several": "slow:worker=*:ms=5:step=7;kill:worker=0:step=3:phase=recovery; ;"
               "stop:worker=1:step=9:secs=0.5:phase=after-reduce",
    "bad_no_step": "kill:worker=2",
    "bad_worker": "kill:worker=x:step=1",
    "bad_zero_ms": "slow:worker=0:ms=0",
    "bad_phase": "kill:worker=1:step=1:phase=sideways",
    "bad_not_key_value": "mute:worker=1:step=2:secs",
})

# --- profile_json: docs/profile_format.md.
with open(os.path.join(ROOT, "..", "docs", "profile_example.json")) as f:
    example = f.read()


def profile(layers, **job):
    j = {"devices_per_node": 2, "device_memory_bytes": 16 << 30, "inter_stage_gbps": 100,
         "allreduce": {"algorithm": "ring", "bandwidth_gbps": 200, "latency_us": 5}}
    j.update(job)
    return json.dumps({"version": 1, "microbatch_size": 4, "job": j, "layers": layers})


layer = {"name": "l0", "forward_ms": 1.5, "backward_ms": 3.0, "param_bytes": 4096,
         "optimizer_bytes": 8192, "activation_bytes": 1024, "output_bytes": 512}
write_corpus("profile_json", {
    "example": example,
    "one_layer": profile([layer]),
    "two_layers": profile([layer, dict(layer, name="l1", forward_ms=0.001)]),
    "integral_floats": profile([dict(layer, param_bytes=1e9)]),
    "bad_no_layers": profile([]),
    "bad_negative_time": profile([dict(layer, forward_ms=-1)]),
    "bad_algorithm": profile([layer], allreduce={"algorithm": "tree", "bandwidth_gbps": 1,
                                                  "latency_us": 0}),
    "bad_devices": profile([layer], devices_per_node=0),
    "bad_truncated": profile([layer])[:60],
})


# --- plan_json: pipeline::planToJson (docs/pipeline.md, "The plan on the wire").
def plan(pipelines, workers, microbatches=None, layers=10, **extra):
    p = {"epoch": 1, "num_layers": layers,
         "microbatches": microbatches if microbatches is not None
         else sum(q["microbatches"] for q in pipelines),
         "fault_tolerance": 1, "iteration_ticks": 1000, "idle": [],
         "pipelines": pipelines, "workers": workers}
    p.update(extra)
    return json.dumps(p)


two_pipes = [{"nodes": 2, "node_ids": [0, 1], "microbatches": 5, "iteration_ticks": 900},
             {"nodes": 1, "node_ids": [2], "microbatches": 3, "iteration_ticks": 1000}]
two_pipes_workers = [[0, 0, 0, 0, 0, 0, 4], [1, 1, 0, 0, 1, 4, 10], [2, 2, 0, 1, 0, 0, 10]]
write_corpus("plan_json", {
    "two_pipelines": plan(two_pipes, two_pipes_workers),
    "wide_stages": plan([{"nodes": 1, "node_ids": [0], "microbatches": 4, "iteration_ticks": 7}],
                        [[0, 0, 0, 0, 0, 0, 10], [1, 0, 1, 0, 0, 0, 10]]),
    "bad_sum": plan(two_pipes, two_pipes_workers, microbatches=9),
    "bad_layer_range": plan(two_pipes, [[0, 0, 0, 0, 0, 4, 4]]),
    "bad_skipped_stage": plan(two_pipes, [[0, 0, 0, 0, 1, 0, 10]]),
    "bad_pipeline_index": plan(two_pipes, [[0, 0, 0, 2, 0, 0, 10]]),
    "bad_huge": plan(two_pipes, two_pipes_workers, epoch=2**70),
    "bad_truncated": plan(two_pipes, two_pipes_workers)[:50],
})


# --- shard_layout: ShardLayout::toJson, a NUL, then the shard's bytes.
def shard_layout(tensors, total=None, data=None):
    """tensors: (layer, name, dtype, shape, nbytes); data defaults to a byte pattern."""
    recs, off = [], 0
    size = sum(t[4] for t in tensors)
    data = bytes((i * 7) & 0xFF for i in range(size)) if data is None else data
    for layer, name, dtype, shape, nbytes in tensors:
        recs.append({"layer": layer, "name": name, "dtype": dtype, "shape": shape,
                     "offset": off, "nbytes": nbytes, "crc32c": crc32c(data[off:off + nbytes])})
        off += nbytes
    text = json.dumps({"total_bytes": size if total is None else total, "tensors": recs})
    return text.encode() + b"\0" + data


def shifted(blob, **changes):
    text, _, data = blob.partition(b"\0")
    j = json.loads(text)
    for k, v in changes.items():
        j["tensors"][0][k] = v
    return json.dumps(j).encode() + b"\0" + data


two_layers = [("emb", "weight", "F32", [4, 2], 32), ("emb", "weight.exp_avg", "F32", [4, 2], 32),
              ("fc", "bias", "BF16", [3], 6)]
write_corpus("shard_layout", {
    "two_layers": shard_layout(two_layers),
    "all_dtypes": shard_layout([("l", d, d, [2], 2 * s) for d, s in
                                [("F64", 8), ("F32", 4), ("F16", 2), ("BF16", 2), ("I64", 8),
                                 ("I32", 4), ("I16", 2), ("I8", 1), ("U8", 1), ("BOOL", 1)]]),
    "empty": shard_layout([]),
    "scalar": shard_layout([("s", "step", "I64", [], 8)]),
    "bad_truncated_json": shard_layout(two_layers)[:70],
    "bad_dtype": shifted(shard_layout(two_layers), dtype="F8"),
    "bad_crc": shifted(shard_layout(two_layers), crc32c=1),
})


# --- checkpoint_reader: a checkpoint folder as "@@ <path>" sections (persist.cc's format).
def safetensors(tensors, step, owner):
    """tensors: (layer, name, dtype, shape, bytes) → (file bytes, tensor records)."""
    header = {"__metadata__": {"format": "pt", "sinew_step": str(step), "sinew_owner": str(owner)}}
    off, data, recs = 0, b"", []
    for layer, name, dtype, shape, raw in tensors:
        header[layer + "/" + name] = {"dtype": dtype, "shape": shape,
                                      "data_offsets": [off, off + len(raw)]}
        recs.append((layer, name, dtype, shape, off, len(raw), crc32c(raw)))
        off += len(raw)
        data += raw
    h = json.dumps(header, separators=(",", ":"))
    h += " " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h.encode() + data, recs


def checkpoint(step, shards, latest=True, older=None):
    """shards: {owner: tensors}. Returns {path: bytes} of a durable version."""
    vdir = "step-%08d" % step
    files, mfiles, layers = {}, {}, {}
    for owner, tensors in shards.items():
        rel = "%s/shard-w%d.safetensors" % (vdir, owner)
        blob, recs = safetensors(tensors, step, owner)
        files[rel] = blob
        mfiles[rel] = {"bytes": len(blob), "crc32c": hex32(crc32c(blob))}
        for layer, name, dtype, shape, off, n, crc in recs:
            l = layers.setdefault(layer, {"owner": owner, "file": rel, "digest": hex32(0),
                                          "tensors": {}})
            l["tensors"][name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n],
                                  "crc32c": hex32(crc)}
    if older:  # Incremental: layers kept in an older version's file.
        for layer, (rel, meta, loc) in older.items():
            mfiles[rel] = meta
            layers[layer] = loc
    manifest = json.dumps({"format": "sinew-checkpoint", "format_version": 1, "step": step,
                           "files": mfiles, "layers": layers}, indent=1, sort_keys=True)
    files[vdir + "/manifest.json"] = manifest.encode()
    if latest:
        files["LATEST"] = (json.dumps({"step": step, "manifest": vdir + "/manifest.json",
                                       "manifest_crc32c": hex32(crc32c(manifest.encode()))})
                           + "\n").encode()
    return files


def bundle(files):
    # The harness ends a file where the next "\n@@ " begins, or at the end of the input.
    return b"\n".join(b"@@ " + p.encode() + b"\n" + d for p, d in sorted(files.items()))


def f32(*vals):
    return struct.pack("<%df" % len(vals), *vals)


w0 = [("emb", "weight", "F32", [2, 2], f32(1, 2, 3, 4)),
      ("emb", "weight.exp_avg", "F32", [2, 2], f32(0, 0, 0, 0))]
w1 = [("fc", "bias", "F32", [3], f32(0.5, -0.5, 1)), ("fc", "step", "I64", [], struct.pack("<q", 7))]
v1 = checkpoint(1, {0: w0, 1: w1})
truncated = dict(v1)
truncated["step-00000001/shard-w0.safetensors"] = v1["step-00000001/shard-w0.safetensors"][:-4]
bad_crc = dict(v1)
bad_crc["LATEST"] = v1["LATEST"].replace(b'"manifest_crc32c": "0x', b'"manifest_crc32c": "0x1')
flipped = dict(v1)
blob = bytearray(v1["step-00000001/shard-w1.safetensors"])
blob[-1] ^= 0xFF
flipped["step-00000001/shard-w1.safetensors"] = bytes(blob)
m1 = json.loads(v1["step-00000001/manifest.json"])
older = {"emb": ("step-00000001/shard-w0.safetensors",
                 m1["files"]["step-00000001/shard-w0.safetensors"], m1["layers"]["emb"])}
v2 = checkpoint(2, {1: [("fc", "bias", "F32", [3], f32(1, 1, 1))]}, older=older)
write_corpus("checkpoint_reader", {
    "one_version": bundle(v1),
    "one_shard": bundle(checkpoint(5, {0: w0})),
    "incremental": bundle({**{k: v for k, v in v1.items() if k != "LATEST"}, **v2}),
    "no_latest": bundle(checkpoint(3, {0: w1}, latest=False)),
    "bad_truncated_shard": bundle(truncated),
    "bad_manifest_crc": bundle(bad_crc),
    "bad_tensor_crc": bundle(flipped),
})


# --- The one transport (docs/transport.md) and each port's messages.
TOKEN = 0x5157a3d2c0ffee01  # fuzz/frame_header.cc's kToken


def frame(choice, service, type_, length, token=TOKEN, epoch=0, magic=0x46574E53, version=1,
          flags=0, reserved=0):
    return bytes([choice]) + struct.pack("<IBBBBIIQq", magic, version, service, type_, flags,
                                         length, reserved, token, epoch)


write_corpus("frame_header", {
    "store_set": frame(0, 1, 1, 20),
    "store_answer_ok": frame(1, 1, 0x81, 9),
    "coordinator_hello": frame(2, 2, 1, 40, epoch=3),
    "coordinator_epoch": frame(3, 2, 7, 200, epoch=4),
    "replica_begin": frame(4, 3, 1, 300),
    "replica_chunk": frame(4, 3, 2, 4 << 20),
    "replica_get_reply": frame(5, 3, 8, 120),
    "bad_magic": frame(0, 1, 1, 20, magic=0x54534E53),
    "bad_version": frame(0, 1, 1, 20, version=2),
    "bad_service": frame(0, 2, 1, 20),
    "bad_token": frame(2, 2, 1, 20, token=TOKEN ^ 1),
    "bad_type": frame(4, 3, 9, 0),
    "bad_flags": frame(0, 1, 1, 0, flags=1),
    "bad_reserved": frame(0, 1, 1, 0, reserved=7),
    "bad_length": frame(2, 2, 1, 0xFFFFFFFF),
    "bad_length_of_type": frame(4, 3, 3, 1),
    "short": frame(0, 1, 1, 0)[:17],
})


def sbytes(b):
    if isinstance(b, str):
        b = b.encode()
    return struct.pack("<I", len(b)) + b


def keys(ks):
    return struct.pack("<I", len(ks)) + b"".join(sbytes(k) for k in ks)


write_corpus("store_message", {
    "set": bytes([1]) + sbytes("epoch/3/gloo/0") + sbytes(b"127.0.0.1:4242"),
    "get": bytes([2]) + struct.pack("<q", 30000) + sbytes("k"),
    "add": bytes([3]) + sbytes("counter") + struct.pack("<q", -5),
    "compare_set": bytes([4]) + sbytes("k") + sbytes(b"") + sbytes(b"v"),
    "wait": bytes([5]) + struct.pack("<q", 100) + keys(["a", "b/c"]),
    "check": bytes([6]) + keys(["a"]),
    "delete": bytes([7]) + sbytes("k"),
    "answer_bytes": bytes([0x81]) + sbytes(b"value"),
    "answer_i64": bytes([0x81]) + struct.pack("<q", 7),
    "bad_negative_timeout": bytes([2]) + struct.pack("<q", -1) + sbytes("k"),
    "bad_trailing": bytes([7]) + sbytes("k") + b"x",
    "bad_length": bytes([1]) + struct.pack("<I", 0xFFFFFFF0) + b"k",
    "bad_type": bytes([9]) + sbytes("k"),
})


def body(type_, j):
    return bytes([type_]) + json.dumps(j, separators=(",", ":")).encode()


write_corpus("coordinator_message", {
    "hello": body(1, {"worker": 2, "node": "n2", "pid": 4242}),
    "hello_join": body(1, {"worker": -1, "node": "joiner-1"}),
    "welcome": body(2, {"worker": 2, "store_host": "127.0.0.1", "store_port": 5000,
                        "heartbeat_ms": 100, "dead_after_ms": 3000}),
    "heartbeat": body(3, {"step": 17}),
    "lost": body(4, {"worker": 1}),
    "vote": body(5, {"step": 18}),
    "commit": body(6, {"step": 18, "next_epoch": True}),
    "epoch": body(7, {"epoch": 2, "members": [0, 2, 3], "resume_step": 18, "source": 0,
                      "joined": [3], "sync": True}),
    "done": body(8, {"step": 40}),
    "expelled": body(9, {"reason": "missed heartbeats"}),
    "rebuild": body(10, {}),
    "ready": body(11, {"resume_step": 18}),
    "leave": body(12, {"step": 20}),
    "released": body(13, {"step": 20, "reason": "drained"}),
    "bad_worker_overflow": body(1, {"worker": 2147483647, "node": "n"}),
    "bad_unsigned": body(5, {"step": 18446744073709551615}),
    "bad_float": body(3, {"step": 1.5}),
    "bad_members": body(7, {"epoch": 2, "members": [0, -1], "resume_step": 0, "source": 0,
                            "joined": [], "sync": False}),
    "bad_not_object": body(3, [1]),
    "bad_json": bytes([3]) + b'{"step":',
})


def layout_json(tensors, total):
    return json.dumps({"total_bytes": total, "tensors": tensors}, separators=(",", ":"))


lay = layout_json([
    {"layer": "fc1", "name": "weight", "dtype": "F32", "shape": [2, 2], "offset": 0,
     "nbytes": 16, "crc32c": 0},
    {"layer": "fc1", "name": "exp_avg", "dtype": "F32", "shape": [2, 2], "offset": 64,
     "nbytes": 16, "crc32c": 0}], 80)
sid = struct.pack("<iq", 1, 12)
write_corpus("replica_message", {
    "begin": bytes([0]) + sid + lay.encode(),
    "begin_empty": bytes([0]) + sid + layout_json([], 0).encode(),
    "get": bytes([1]) + sid,
    "list": bytes([2]) + json.dumps([{"owner": 1, "step": 12, "layout": lay}]).encode(),
    "list_empty": bytes([2]) + b"[]",
    "bad_begin_owner": bytes([0]) + struct.pack("<iq", -1, 12) + lay.encode(),
    "bad_begin_short": bytes([0]) + sid[:7],
    "bad_get_step": bytes([1]) + struct.pack("<iq", 1, -3),
    "bad_list_owner": bytes([2]) + json.dumps([{"owner": 1 << 40, "step": 1,
                                                "layout": lay}]).encode(),
    "bad_list_layout": bytes([2]) + json.dumps([{"owner": 1, "step": 1, "layout": 5}]).encode(),
    "get_layers": bytes([3]) + sid + json.dumps(["fc1", "head"]).encode(),
    "bad_get_layers_empty": bytes([3]) + sid + b"[]",
    "bad_get_layers_name": bytes([3]) + sid + json.dumps(["fc1", 7]).encode(),
})


# --- Findings (docs/fuzzing.md, "Findings"): each input crashed its harness on the code of
# 2026-11-22. Not part of the corpora, so a short CI run still explores past them.
write_corpus("inject_spec", {
    "worker_big": "kill:worker=99999999999:step=1",
    "step_1e300": "kill:worker=1:step=1e300",
    "secs_inf": "stop:worker=1:step=1:secs=inf",
    "ms_nan": "slow:worker=0:ms=nan",
}, kind="regressions")
write_corpus("profile_json", {
    "number_overflow": '{"version": 1, "job": {"devices_per_node": 1e400}}',
}, kind="regressions")


def layout1(total, shape, offset, nbytes):
    """One F32 tensor a/t, as ShardLayout::toJson writes it; no shard bytes."""
    return json.dumps({"total_bytes": total, "tensors": [
        {"layer": "a", "name": "t", "dtype": "F32", "shape": shape, "offset": offset,
         "nbytes": nbytes, "crc32c": 0}]}, separators=(",", ":"))


write_corpus("shard_layout", {
    "past_total": layout1(0, [0], 0, 8),
    "extract_overflow": layout1(16, [1], 0, 16),
    "offset_wrap": layout1(8, [2], (1 << 64) - 8, 16),
    "negative_dim": layout1(0, [-1], 0, 0),
    "huge_shape": layout1(0, [1 << 40], 0, 0),
}, kind="regressions")


def compact(j):
    return json.dumps(j, separators=(",", ":")).encode()


def manifest1(files, tensors):
    """Version 1 with one layer a in file f (checksums are not checked before the crash)."""
    return b"@@ step-00000001/manifest.json\n" + compact(
        {"format": "sinew-checkpoint", "format_version": 1, "step": 1, "files": files,
         "layers": {"a": {"owner": 0, "file": "f", "digest": "0x0", "tensors": tensors}}})


def shaped(shape, n):
    """File f holds a/t with n bytes; manifest and header both give it `shape`."""
    h = compact({"a/t": {"dtype": "F32", "shape": shape, "data_offsets": [0, n]}})
    f = struct.pack("<Q", len(h)) + h + b"\0" * n
    t = {"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, n], "crc32c": "0x0"}}
    return manifest1({"f": {"bytes": len(f), "crc32c": "0x0"}}, t) + b"\n@@ f\n" + f


write_corpus("checkpoint_reader", {
    "step_dir_not_a_number": b"@@ step-x/manifest.json\n",
    "step_dir_out_of_range": b"@@ step-99999999999999999999/manifest.json\n",
    "file_not_listed": manifest1({}, {}) + b"\n@@ f\n",
    "shape_smaller_than_bytes": shaped([1], 16),
    "negative_dim": shaped([-1], 0),
    "huge_shape": shaped([1 << 40], 0),
}, kind="regressions")


# --- control_request: HTTP requests to the control API (runtime/control_api.h). The harness's
# token is 0123456789abcdef.
AUTH = "Authorization: Bearer 0123456789abcdef\r\n"


def post(path, body, extra=""):
    return ("POST %s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n%s"
            % (path, AUTH, extra, len(body), body))


write_corpus("control_request", {
    "status": "GET /v1/status HTTP/1.1\r\nHost: x\r\n" + AUTH + "\r\n",
    "metrics": "GET /metrics HTTP/1.1\r\n" + AUTH + "\r\n",
    "events": "GET /v1/events HTTP/1.1\r\n" + AUTH + "Last-Event-ID: 5\r\n\r\n",
    "resize": post("/v1/resize", '{"nodes": 6}'),
    "drain": post("/v1/drain", '{"workers": [1, 2], "deadline_s": 30}'),
    "drain_chunked": "POST /v1/drain HTTP/1.1\r\n" + AUTH + "Transfer-Encoding: chunked\r\n\r\n"
                     "24\r\n{\"nodes\": [\"n1\"], \"deadline_s\": 0.5}\r\n0\r\n\r\n",
    "checkpoint": post("/v1/checkpoint", '{"durable": true}'),
    "stop": post("/v1/stop", '{"deadline_s": 60}'),
    "no_token": "GET /v1/status HTTP/1.1\r\n\r\n",
})


# --- layer_copy_manifest: a layer copy's manifest (runtime/layer_copy_manifest.h). One byte,
# the parameter count n, then 2n + 1 little-endian int64 words: flags, step counts, crc32c.
def layer_manifest(flags, steps, crc, n=None):
    n = len(flags) if n is None else n
    return bytes([n]) + struct.pack("<%dq" % (len(flags) + len(steps) + 1), *flags, *steps, crc)


write_corpus("layer_copy_manifest", {
    "adam_two_params": layer_manifest([1, 1], [12, 12], 0x1234ABCD),
    "amsgrad": layer_manifest([3], [4], 0xFFFFFFFF),
    "sgd_momentum": layer_manifest([4, 4, 0], [0, 0, 0], 7),
    "no_state": layer_manifest([0], [0], 0),
    "no_parameters": layer_manifest([], [], 0),
    "bad_flags": layer_manifest([8], [0], 0),
    "bad_adam_and_momentum": layer_manifest([5], [1], 0),
    "bad_max_without_adam": layer_manifest([2], [0], 0),
    "bad_negative_step": layer_manifest([1], [-1], 0),
    "bad_step_without_adam": layer_manifest([4], [3], 0),
    "bad_crc": layer_manifest([0], [0], 1 << 32),
    "bad_count": layer_manifest([0, 0], [0, 0], 0, n=3),
})
