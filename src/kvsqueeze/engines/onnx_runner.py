"""Run exported static graphs on ONNX Runtime (CPU), reading and writing the manager's buffers in place.

Weights: by default (``share_weights=True``) ``weights.bin`` is memory-mapped once and handed to both sessions
as their initializers, so the prefill and decode graphs share one read-only copy of the model (ORT's MatMul
weight prepacking is turned off for that, since prepacking makes a private copy per session).  With
``share_weights=False`` each session loads and prepacks its own copy: more memory, somewhat faster MatMuls.

Every K/V tensor is bound with IOBinding to a pointer into the manager's buffers: the past inputs are the
window views and the new K/V outputs are the slot after the window, so ONNX Runtime writes the appended token
straight into the shared buffer.  Where a view is not contiguous (the ``"head"`` layout with B * H > 1) the
engine goes through a staging array and adds the bytes to ``stats.staging_bytes``: nothing is copied silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .onnx_export import DECODE_FILE, FORMAT_VERSION, PREFILL_FILE, WEIGHTS_FILE, io_names
from .static_manager import StaticKVManager, check_manager_matches, manager_for

ORT_HINT = 'the ONNX Runtime path needs onnx and onnxruntime: pip install -e ".[onnx]"'


def require_onnxruntime():
    """Import onnxruntime or raise ValueError with the install command."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise ValueError(ORT_HINT) from exc
    return onnxruntime


@dataclass(frozen=True)
class GraphInfo:
    """What a pair of exported graphs was made for (read from their metadata)."""

    fingerprint: str
    max_len: int
    batch_size: int
    layout: str
    kv: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    stored_dim: int
    kv_dtype: str
    vocab_size: int
    quant_digest: str
    extra: dict

    @classmethod
    def from_metadata(cls, meta: dict[str, str], where: str) -> GraphInfo:
        if meta.get("kvsqueeze.format") != FORMAT_VERSION:
            raise ValueError(f"{where} is not a kvsqueeze static graph (format {FORMAT_VERSION}); re-export it")
        g = {k.removeprefix("kvsqueeze."): v for k, v in meta.items() if k.startswith("kvsqueeze.")}
        ints = ("max_len", "batch_size", "n_layers", "n_kv_heads", "head_dim", "stored_dim", "vocab_size")
        known = set(ints) | {"fingerprint", "layout", "kv", "kv_dtype", "quant_digest", "format", "mode",
                             "model_type"}
        return cls(g["fingerprint"], *(int(g[k]) for k in ints[:2]), g["layout"], g["kv"],
                   *(int(g[k]) for k in ints[2:6]), g["kv_dtype"], int(g["vocab_size"]), g["quant_digest"],
                   {k: v for k, v in g.items() if k not in known})

    @property
    def window_shape(self) -> tuple[int, int, int, int]:
        w, b, h, d = self.max_len - 1, self.batch_size, self.n_kv_heads, self.stored_dim
        return (w, b, h, d) if self.layout == "token" else (b, h, w, d)


class OrtStaticEngine:
    """A prefill and a decode session over one exported folder, checked against each other and the model.

    ``fingerprint`` (of the model the caller means) makes graphs of another model a ValueError; ``threads`` sets
    ORT's intra-op threads; ``spin`` lets idle ORT threads busy-wait (faster on an otherwise idle machine);
    ``share_weights`` maps the weights once for both sessions (see the module docstring).
    """

    name = "onnxruntime"

    def __init__(self, onnx_dir: str | Path, *, fingerprint: str | None = None, threads: int | None = None,
                 spin: bool = False, share_weights: bool = True) -> None:
        ort = require_onnxruntime()
        folder = Path(onnx_dir).expanduser()
        paths = {m: folder / f for m, f in (("prefill", PREFILL_FILE), ("decode", DECODE_FILE))}
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            raise ValueError(f"no exported static graphs at {folder} (missing {', '.join(missing)})")
        weights = folder / WEIGHTS_FILE
        self._shared = _map_weights(weights) if share_weights and weights.is_file() else None
        self._values: list = []
        self.sessions = {}
        infos = {}
        for mode, path in paths.items():
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            if threads:
                opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            # idle ORT threads spin by default, which starves torch (or anything else) sharing a small CPU
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
            try:
                if self._shared is not None:
                    self._add_shared_initializers(ort, opts, path)
                sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
            except Exception as exc:  # ORT raises its own exception types for unreadable files
                raise ValueError(f"{path} is not a loadable ONNX graph: {exc}") from exc
            meta = sess.get_modelmeta().custom_metadata_map
            infos[mode] = GraphInfo.from_metadata(meta, str(path))
            if meta.get("kvsqueeze.mode") != mode:
                raise ValueError(f"{path} holds the {meta.get('kvsqueeze.mode')!r} graph, expected {mode!r}")
            self.sessions[mode] = sess
        if infos["prefill"] != infos["decode"]:
            raise ValueError(f"{paths['prefill']} and {paths['decode']} were exported for different settings")
        self.info = infos["decode"]
        if fingerprint is not None and fingerprint != self.info.fingerprint:
            raise ValueError(
                f"the ONNX graphs in {folder} were exported from another model (fingerprint "
                f"{self.info.fingerprint}, this model is {fingerprint}); export again or pick the right --onnx-dir"
            )
        self._check_io()
        self._kv_dtype = np.dtype(self.info.kv_dtype)
        self._logits = np.empty((self.info.batch_size, self.info.vocab_size), np.float32)

    def _add_shared_initializers(self, ort, opts, path: Path) -> None:
        """Point every external initializer of ``path`` at the shared mapping (no per-session copy)."""
        import onnx
        from onnx import helper

        proto = onnx.load(str(path), load_external_data=False)  # the graph only: a few hundred KB
        for init in proto.graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL:
                continue
            ext = {e.key: e.value for e in init.external_data}
            if ext.get("location") != WEIGHTS_FILE:
                raise ValueError(f"{path}: initializer {init.name} points at {ext.get('location')!r}")
            lo, n = int(ext.get("offset", 0)), int(ext["length"])
            if lo + n > self._shared.size:
                raise ValueError(f"{path}: {WEIGHTS_FILE} is truncated; export the graphs again")
            arr = self._shared[lo:lo + n].view(helper.tensor_dtype_to_np_dtype(init.data_type))
            value = ort.OrtValue.ortvalue_from_numpy(arr.reshape(tuple(init.dims)))
            self._values.append(value)  # ORT uses this memory directly: keep it alive with the engine
            opts.add_initializer(init.name, value)
        opts.add_session_config_entry("session.disable_prepacking", "1")  # prepacking would copy each weight

    def _check_io(self) -> None:
        """The sessions' real input/output shapes must be the static ones the metadata promises."""
        info, w, b = self.info, self.info.max_len - 1, self.info.batch_size
        kv = list(info.window_shape)
        new = [1, *kv[1:]] if info.layout == "token" else [*kv[:2], 1, kv[3]]
        expect = {
            "prefill": ({"input_ids": [b, w], "attention_mask": [b, w], "position_ids": [b, w]},
                        {"logits": [b, info.vocab_size], **{n: kv for n in io_names(info.n_layers, "prefill")[1][1:]}}),
            "decode": ({"input_ids": [b, 1], "attention_mask": [b, w + 1], "position_ids": [b, 1],
                        **{n: kv for n in io_names(info.n_layers, "decode")[0][3:]}},
                       {"logits": [b, info.vocab_size], **{n: new for n in io_names(info.n_layers, "decode")[1][1:]}}),
        }
        for mode, (ins, outs) in expect.items():
            sess = self.sessions[mode]
            got_in = {a.name: list(a.shape) for a in sess.get_inputs()}
            got_out = {a.name: list(a.shape) for a in sess.get_outputs()}
            if got_in != ins or got_out != outs:
                raise ValueError(f"the {mode} graph's inputs/outputs do not match its metadata; re-export it")

    # ------------------------------------------------------------------ manager pairing
    def make_manager(self, reserve: float = 2.0, on_full: str = "stop", naive: bool = False) -> StaticKVManager:
        return manager_for(self.info, self._kv_dtype, reserve, on_full, naive)

    def check_manager(self, m: StaticKVManager) -> None:
        check_manager_matches(m, self.info, self._kv_dtype, "the exported graph")

    # ------------------------------------------------------------------ steps
    def prefill(self, m: StaticKVManager, input_ids: np.ndarray, attention_mask: np.ndarray,
                position_ids: np.ndarray) -> np.ndarray:
        """Run the prompt graph; its K/V land in the manager's (reset) window.  Returns logits [B, vocab]."""
        self.check_manager(m)
        w = self.info.max_len - 1
        for name, a in (("input_ids", input_ids), ("attention_mask", attention_mask), ("position_ids", position_ids)):
            if np.shape(a) != (self.info.batch_size, w):
                raise ValueError(f"{name} must have shape {(self.info.batch_size, w)}, got {np.shape(a)}")
        views = m.prefill_views()
        io = self.sessions["prefill"].io_binding()
        keep = [np.ascontiguousarray(a, dtype=np.int64) for a in (input_ids, attention_mask, position_ids)]
        for name, a in zip(("input_ids", "attention_mask", "position_ids"), keep):
            _bind_in(io, name, a)  # bound by pointer: ``keep`` holds the arrays until the run is over
        staged = self._bind_kv_outputs(io, m, views, "key_value")
        self.sessions["prefill"].run_with_iobinding(io)
        self._unstage(m, staged)
        m.commit_prefill(attention_mask.sum(axis=1))
        return self._logits.copy()

    def decode(self, m: StaticKVManager, input_ids: np.ndarray) -> np.ndarray:
        """One token per row: past = the manager's window, new K/V written after it, then committed."""
        if np.shape(input_ids) != (self.info.batch_size, 1):
            raise ValueError(f"input_ids must have shape {(self.info.batch_size, 1)}, got {np.shape(input_ids)}")
        m.prepare(1)
        io = self.sessions["decode"].io_binding()
        # bound by pointer: ``keep`` holds these arrays (and any staging copy) until the run is over
        keep = [np.ascontiguousarray(input_ids, dtype=np.int64), m.attention_mask(), m.position_ids()]
        for name, a in zip(("input_ids", "attention_mask", "position_ids"), keep):
            _bind_in(io, name, a)
        for layer in range(m.n_layers):
            for name, view in zip((f"past_key_{layer}", f"past_value_{layer}"), m.window(layer)):
                if not view.flags.c_contiguous:
                    view = np.ascontiguousarray(view)
                    m.stats.staging_bytes += view.nbytes
                    keep.append(view)
                _bind_in(io, name, view)
        staged = self._bind_kv_outputs(io, m, [m.slot(layer) for layer in range(m.n_layers)], "new")
        self.sessions["decode"].run_with_iobinding(io)
        self._unstage(m, staged)
        m.commit(1)
        return self._logits.copy()

    def _bind_kv_outputs(self, io, m: StaticKVManager, views: list, prefix: str) -> list:
        io.bind_output("logits", "cpu", 0, np.float32, list(self._logits.shape), self._logits.ctypes.data)
        staged = []
        for layer, pair in enumerate(views):
            for name, view in zip((f"{prefix}_key_{layer}", f"{prefix}_value_{layer}"), pair):
                target = view if view.flags.c_contiguous else np.empty(view.shape, view.dtype)
                if target is not view:
                    staged.append((view, target))
                io.bind_output(name, "cpu", 0, target.dtype, list(target.shape), target.ctypes.data)
        return staged

    @staticmethod
    def _unstage(m: StaticKVManager, staged: list) -> None:
        for view, target in staged:
            view[...] = target
            m.stats.staging_bytes += target.nbytes


def _map_weights(path: Path) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r")


def _bind_in(io, name: str, a: np.ndarray) -> None:
    io.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
