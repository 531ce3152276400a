"""The GDN mixer's CPU path against fla's references: the pure-torch recurrence, the module's equations,
padding, dtypes, cached decoding, and (slow) fla's real Triton kernels under TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from transformers import DynamicCache, PretrainedConfig

from tcal.student.gdn import GatedDeltaNet, gated_delta_rule
from tcal.student.gdn_torch import chunk_gated_delta_rule_torch, recurrent_step

ATOL = RTOL = 1e-5
MODULE_TOL = dict(atol=1e-4, rtol=1e-4)  # module outputs are O(1-10): float32 noise of the gated norm and Wo


def random_inputs(B, T, H, K, V, seed=0, with_state=False):
    """Leaf tensors in the kernels' layout: q, k l2-normalized, g = log decay < 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)  # decays mostly in (0.5, 1)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen) if with_state else None
    return q, k, v, g, beta, h0


def run_with_grads(fn, q, k, v, g, beta, h0, seed=1):
    """fn's (o, state) and the gradients of a random linear functional of both w.r.t. q, k, v, g, beta (, h0)."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    state_in = h0.clone().requires_grad_(True) if h0 is not None else None
    o, state = fn(*leaves, state_in)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
    loss.backward()
    grads = [t.grad for t in leaves] + ([state_in.grad] if state_in is not None else [])
    return o.detach(), state.detach(), grads


def reference(q, k, v, g, beta, h0):
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)


def ours_chunk(q, k, v, g, beta, h0):
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)


def ours_dispatch(q, k, v, g, beta, h0):
    return gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)


def assert_close(actual, expected, atol=ATOL, rtol=RTOL, what=""):
    diff = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), f"{what}: max abs diff {diff:.3g}"


SHAPES = [  # B, T, H, K, V
    (2, 100, 3, 16, 8),   # T not a multiple of 64, two chunks, K != V, H = 3
    (1, 37, 1, 8, 16),    # T < 64, one head, K < V
    (2, 128, 2, 16, 16),  # exactly two chunks
    (1, 1, 3, 16, 8),     # a single decode step (dispatcher takes the recurrent step)
]


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_T{}_H{}_K{}_V{}".format(*s))
@pytest.mark.parametrize("impl", [ours_chunk, ours_dispatch], ids=["chunk_torch", "dispatch"])
def test_matches_naive_recurrent(impl, shape, with_state):
    inputs = random_inputs(*shape, with_state=with_state)
    o_ref, s_ref, g_ref = run_with_grads(reference, *inputs)
    o, s, grads = run_with_grads(impl, *inputs)
    assert o.dtype == s.dtype == torch.float32
    assert o.shape == o_ref.shape and s.shape == s_ref.shape == (shape[0], shape[2], shape[3], shape[4])
    assert_close(o, o_ref, what="output")
    assert_close(s, s_ref, what="final state")
    names = ["q", "k", "v", "g", "beta", "h0"]
    assert len(grads) == len(g_ref)
    for name, a, b in zip(names, grads, g_ref):
        assert_close(a, b, atol=2e-5, rtol=2e-5, what=f"d{name}")


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_long_sequence_without_autograd_matches_naive_recurrent(with_state):
    """Past INFERENCE_SEGMENT tokens without autograd the chunk path runs in pieces (the last one partial)."""
    inputs = random_inputs(2, 600, 3, 16, 8, with_state=with_state)
    o_ref, s_ref = reference(*inputs)
    with torch.no_grad():
        o, s = ours_chunk(*inputs)
    o_whole, s_whole = (t.detach() for t in ours_chunk(*(t.clone().requires_grad_() if t is not None else None
                                                          for t in inputs)))  # recording: the whole sequence
    assert_close(o, o_ref, what="output")
    assert_close(s, s_ref, what="final state")
    torch.testing.assert_close(o, o_whole, rtol=1e-6, atol=1e-6)  # the same chunks as the whole sequence at once
    torch.testing.assert_close(s, s_whole, rtol=1e-6, atol=1e-6)


def test_no_final_state_unless_asked():
    q, k, v, g, beta, _ = random_inputs(1, 10, 2, 8, 8)
    for T in (1, 10):
        o, state = gated_delta_rule(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T])
        assert state is None and o.shape == (1, T, 2, 8)


def test_recurrent_step_is_one_token_of_the_rule():
    q, k, v, g, beta, h0 = random_inputs(2, 1, 3, 8, 4, with_state=True)
    o_ref, s_ref = reference(q, k, v, g, beta, h0)
    o, s = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0, 8**-0.5)
    assert_close(o, o_ref[:, 0])
    assert_close(s, s_ref)
    state = h0.clone()
    o, s = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, 8**-0.5, in_place=True)
    assert s is state  # the given state updated, no new tensor
    assert_close(o, o_ref[:, 0])
    assert_close(state, s_ref)


# ----------------------------------------------------------------------------------------------------------
# The module

D, H, DH = 64, 4, 16


def make_gdn(seed=0, hidden=D, heads=H, head_dim=DH) -> GatedDeltaNet:
    """A GDN with all parameters random and non-trivial (norm weight and gates included)."""
    torch.manual_seed(seed)
    gdn = GatedDeltaNet(hidden, heads, head_dim, layer_idx=0)
    with torch.no_grad():
        for proj in (gdn.q_proj, gdn.k_proj, gdn.v_proj, gdn.g_proj, gdn.o_proj, gdn.a_proj, gdn.b_proj):
            proj.weight.normal_(0, 0.3)
        gdn.o_norm.weight.uniform_(0.5, 1.5)
        gdn.A_log.uniform_(-2, 1)
    return gdn.eval()


def equations_by_hand(gdn: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """The equations of docs/method.md, section "The GDN layer", token by token, float64, the state a [V, K] matrix:
    S_t = exp(g_t)(S - beta S k k^T) + beta v k^T; o_t = S_t q_t / sqrt(dk); y = Wo(RMSNorm(o) * silu(Wg x))."""
    B, T, _ = x.shape
    Hn, dh = gdn.num_heads, gdn.head_dim
    projections = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")
    W = {name: getattr(gdn, name).weight.double() for name in projections}
    A_log, dt_bias, norm_w = gdn.A_log.double(), gdn.dt_bias.double(), gdn.o_norm.weight.double()
    eps = gdn.o_norm.eps
    x = x.double()
    out = torch.zeros(B, T, x.shape[-1], dtype=torch.float64)
    eye = torch.eye(dh, dtype=torch.float64)
    for b in range(B):
        S = torch.zeros(Hn, dh, dh, dtype=torch.float64)
        for t in range(T):
            xt = x[b, t]
            q = F.normalize(F.silu(W["q_proj"] @ xt).view(Hn, dh), dim=-1)
            k = F.normalize(F.silu(W["k_proj"] @ xt).view(Hn, dh), dim=-1)
            v = F.silu(W["v_proj"] @ xt).view(Hn, dh)
            beta = torch.sigmoid(W["b_proj"] @ xt)
            g = -A_log.exp() * F.softplus(W["a_proj"] @ xt + dt_bias)
            gate = (W["g_proj"] @ xt).view(Hn, dh)
            y = torch.zeros(Hn, dh, dtype=torch.float64)
            for h in range(Hn):
                kk = k[h][:, None] @ k[h][None, :]
                S[h] = g[h].exp() * (S[h] @ (eye - beta[h] * kk)) + beta[h] * v[h][:, None] @ k[h][None, :]
                o = S[h] @ q[h] / math.sqrt(dh)
                o = o / torch.sqrt(o.pow(2).mean() + eps) * norm_w
                y[h] = o * F.silu(gate[h])
            out[b, t] = W["o_proj"] @ y.reshape(-1)
    return out


def test_module_matches_the_equations():
    gdn = make_gdn()
    x = torch.randn(2, 70, D)  # crosses a chunk boundary
    with torch.no_grad():
        y, _ = gdn(x)
    with torch.no_grad():
        expected = equations_by_hand(gdn, x).float()
    assert y.shape == x.shape and y.dtype == torch.float32
    assert_close(y, expected, **MODULE_TOL, what="module vs equations")


def test_parameter_names_and_shapes_are_fla():
    gdn = GatedDeltaNet(D, H, DH)
    inner = H * DH
    shapes = {name: tuple(p.shape) for name, p in gdn.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (inner, D), "k_proj.weight": (inner, D), "v_proj.weight": (inner, D),
        "g_proj.weight": (inner, D), "a_proj.weight": (H, D), "b_proj.weight": (H, D),
        "A_log": (H,), "dt_bias": (H,), "o_norm.weight": (DH,), "o_proj.weight": (D, inner),
    }


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_matches_unpadded_sequences(side):
    gdn = make_gdn()
    lengths = [70, 9]  # one sequence crosses a chunk boundary, one is mostly padding
    T = max(lengths)
    seqs = [torch.randn(1, n, D) for n in lengths]
    x = torch.randn(len(lengths), T, D) * 5  # garbage at padded positions
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    spans = []
    for b, (n, seq) in enumerate(zip(lengths, seqs)):
        span = slice(T - n, T) if side == "left" else slice(0, n)
        x[b, span] = seq[0]
        mask[b, span] = 1
        spans.append(span)
    with torch.no_grad():
        y, _ = gdn(x, linear_attention_mask=mask)
        _, state = gdn.mix(x, mask, output_final_state=True)
        for b, (span, seq) in enumerate(zip(spans, seqs)):
            alone, _ = gdn(seq)
            _, alone_state = gdn.mix(seq, output_final_state=True)
            assert_close(y[b, span], alone[0], **MODULE_TOL, what=f"{side}-padded output of sequence {b}")
            assert_close(state[b], alone_state[0], **MODULE_TOL, what=f"{side}-padded final state of sequence {b}")


def test_bfloat16_runs_and_stays_close():
    gdn = make_gdn()
    x = torch.randn(2, 50, D)
    with torch.no_grad():
        y32, _ = gdn(x)
        gdn16 = make_gdn().to(torch.bfloat16)
        y16, _ = gdn16(x.to(torch.bfloat16))
        _, state16 = gdn16.mix(x.to(torch.bfloat16), output_final_state=True)
    assert y16.dtype == torch.bfloat16 and state16.dtype == torch.float32
    assert torch.isfinite(y16).all()
    rel = (y16.float() - y32).norm() / y32.norm()
    assert rel < 0.05, f"bf16 relative error {rel:.3g}"


def test_bfloat16_backward():
    gdn = make_gdn().to(torch.bfloat16).train()
    x = torch.randn(1, 40, D, dtype=torch.bfloat16)
    y, _ = gdn(x)
    y.float().square().mean().backward()
    for name, p in gdn.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all(), name


def one_layer_cache() -> DynamicCache:
    return DynamicCache(config=PretrainedConfig(layer_types=["linear_attention"], num_hidden_layers=1))


@pytest.mark.parametrize("prefill", [1, 37, 64, 70])
def test_prefill_then_steps_equals_full_sequence(prefill):
    gdn = make_gdn()
    x = torch.randn(2, 80, D)
    with torch.no_grad():
        full, _ = gdn(x)
        _, full_state = gdn.mix(x, output_final_state=True)
        cache = one_layer_cache()
        pieces = [gdn(x[:, :prefill], cache=cache)[0]]
        cached = cache.layers[0].recurrent_states[0]
        for t in range(prefill, x.shape[1]):
            pieces.append(gdn(x[:, t:t + 1], cache=cache)[0])
    assert cache.layers[0].recurrent_states[0] is cached  # the steps wrote the cached state in place
    assert_close(torch.cat(pieces, 1), full, **MODULE_TOL, what="prefill + steps")
    assert_close(cache.layers[0].recurrent_states[0], full_state, **MODULE_TOL, what="cached state")


def test_chunked_prefill_in_pieces_equals_full_sequence():
    gdn = make_gdn()
    x = torch.randn(1, 150, D)
    with torch.no_grad():
        full, _ = gdn(x)
        cache = one_layer_cache()
        pieces = [gdn(x[:, a:b], cache=cache)[0] for a, b in ((0, 50), (50, 51), (51, 140), (140, 150))]
    assert_close(torch.cat(pieces, 1), full, **MODULE_TOL, what="piecewise prefill")


def test_gradients_reach_every_parameter():
    gdn = make_gdn().train()
    x = torch.randn(2, 70, D, requires_grad=True)
    y, _ = gdn(x)
    y.square().mean().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in gdn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fla's Triton kernels on a GPU)")
def test_cuda_path_matches_cpu_path():
    """The CUDA path (fla's chunk kernel) and the CPU path share parameters and agree, state included.
    Loose tolerance: fla's kernels may use TF32 matmuls for float32 inputs."""
    gdn = make_gdn()
    x = torch.randn(2, 150, D)
    tol = dict(atol=2e-2, rtol=2e-2)
    y_cpu, _ = gdn(x)
    y_cpu.square().mean().backward()
    grads_cpu = {n: p.grad.clone() for n, p in gdn.named_parameters()}
    gdn.zero_grad()
    gpu = gdn.cuda()
    y_gpu, _ = gpu(x.cuda())
    y_gpu.square().mean().backward()
    assert_close(y_gpu.cpu().detach(), y_cpu.detach(), **tol, what="cuda vs cpu output")
    for name, p in gpu.named_parameters():
        assert_close(p.grad.cpu(), grads_cpu[name], atol=2e-2, rtol=5e-2, what=f"cuda vs cpu d{name}")
    with torch.no_grad():
        _, s_gpu = gpu.mix(x.cuda(), output_final_state=True)
        _, s_cpu = gdn.cpu().mix(x, output_final_state=True)
    assert s_gpu.shape == s_cpu.shape
    assert_close(s_gpu.cpu().float(), s_cpu, **tol, what="cuda vs cpu final state")


# ----------------------------------------------------------------------------------------------------------
# fla's real Triton kernels, run on a CPU by Triton's interpreter (slow)

FLA_SCRIPT = textwrap.dedent('''
    """Runs fla's Triton kernels under TRITON_INTERPRET=1 on inputs.pt, writes fla_out.pt."""
    import ast
    import os
    import sys

    assert os.environ.get("TRITON_INTERPRET") == "1", "TRITON_INTERPRET must be set before triton is imported"
    import torch
    from triton.runtime import autotuner, interpreter

    # (1) Benchmarking configs needs a GPU driver: keep only the first config of every autotuner.
    _init = autotuner.Autotuner.__init__

    def _first_config_only(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.configs = self.configs[:1]

    autotuner.Autotuner.__init__ = _first_config_only

    # (2) The interpreter leaves `for i in range(...)` targets as Python ints, and fla calls `.to()` on them:
    # re-wrap each loop target as a Triton tensor at the top of the loop body.
    def _visit_For(self, node):
        node = self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            name = node.target.id
            wrap = ast.Assign(
                targets=[ast.Name(id=name, ctx=ast.Store())],
                value=ast.Call(
                    func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                       ctx=ast.Load()),
                    args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)], keywords=[]),
            )
            node.body.insert(0, ast.copy_location(wrap, node))
        return node

    interpreter.ASTTransformer.visit_For = _visit_For

    # Count kernel launches, to prove the Triton kernels (not a torch fallback) produced the numbers.
    launches = []
    _run = interpreter.InterpretedFunction.run

    def _counted_run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return _run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = _counted_run

    from fla.layers import GatedDeltaNet as FlaGatedDeltaNet
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    folder = sys.argv[1]
    data = torch.load(os.path.join(folder, "inputs.pt"), weights_only=True)
    out = {"ops": [], "layer": {}}

    for case in data["ops"]:
        leaves = [case[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        h0 = case["h0"].clone().requires_grad_(True) if case["h0"] is not None else None
        o, s = chunk_gated_delta_rule(*leaves[:3], g=leaves[3], beta=leaves[4], scale=case["scale"],
                                      initial_state=h0, output_final_state=True)
        ((o * case["wo"]).sum() + (s * case["ws"]).sum()).backward()
        grads = [t.grad for t in leaves] + ([h0.grad] if h0 is not None else [])
        out["ops"].append({"o": o.detach(), "state": s.detach(), "grads": grads})

    layer = FlaGatedDeltaNet(hidden_size=data["hidden"], expand_v=1, head_dim=data["head_dim"],
                             num_heads=data["heads"], use_short_conv=False, use_gate=True, mode="chunk")
    layer.load_state_dict(data["state_dict"], strict=True)  # same names and shapes as ours
    layer.eval()
    lay = out["layer"]
    with torch.no_grad():  # no grad, T <= 64: fla's fused_recurrent kernel; T > 64: chunk
        lay["short"] = layer(data["x_short"])[0]
        lay["long"] = layer(data["x_long"])[0]
        lay["padded"] = layer(data["x_padded"], attention_mask=data["mask"])[0]
    x = data["x_long"].clone().requires_grad_(True)  # grad enabled: chunk kernels, backward included
    y = layer(x)[0]
    (y * data["wy"]).sum().backward()
    lay["long_grad_y"] = y.detach()
    lay["x_grad"] = x.grad
    lay["param_grads"] = {name: p.grad for name, p in layer.named_parameters()}
    out["launches"] = sorted(set(launches))
    out["num_launches"] = len(launches)
    torch.save(out, os.path.join(folder, "fla_out.pt"))
''')


@pytest.mark.slow
def test_matches_fla_triton_kernels_under_interpreter(tmp_path):
    hidden, heads, head_dim = 32, 2, 16
    ops = []
    for i, (T, with_state) in enumerate([(20, False), (70, True), (64, False)]):
        q, k, v, g, beta, h0 = random_inputs(1, T, heads, head_dim, head_dim, seed=10 + i, with_state=with_state)
        gen = torch.Generator().manual_seed(100 + i)
        ops.append(dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, scale=head_dim**-0.5,
                        wo=torch.randn(q.shape[:3] + (head_dim,), generator=gen),
                        ws=torch.randn(1, heads, head_dim, head_dim, generator=gen)))
    gdn = make_gdn(hidden=hidden, heads=heads, head_dim=head_dim)
    torch.manual_seed(5)
    x_padded = torch.randn(2, 30, hidden)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :12] = 0  # left padding of the second sequence
    data = dict(ops=ops, hidden=hidden, heads=heads, head_dim=head_dim,
                state_dict={k: v.clone() for k, v in gdn.state_dict().items()},
                x_short=torch.randn(1, 20, hidden), x_long=torch.randn(1, 70, hidden),
                x_padded=x_padded, mask=mask, wy=torch.randn(1, 70, hidden))
    torch.save(data, tmp_path / "inputs.pt")
    script = tmp_path / "fla_interpret.py"
    script.write_text(FLA_SCRIPT)

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=900)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, f"fla under TRITON_INTERPRET failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    fla = torch.load(tmp_path / "fla_out.pt", weights_only=True)
    print(f"fla interpreter subprocess: {elapsed:.1f} s, {fla['num_launches']} kernel launches: "
          + json.dumps(fla["launches"]))
    # The numbers really come from fla's Triton kernels: chunked forward and backward, fused recurrent, norms.
    assert fla["num_launches"] > 10
    launched = " ".join(fla["launches"])
    assert "chunk" in launched and "recurrent" in launched

    tol = dict(atol=1e-4, rtol=1e-4)
    for i, (case, res) in enumerate(zip(ops, fla["ops"])):
        leaves = [case[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        h0 = case["h0"].clone().requires_grad_(True) if case["h0"] is not None else None
        o, s = gated_delta_rule(*leaves, initial_state=h0, output_final_state=True)
        ((o * case["wo"]).sum() + (s * case["ws"]).sum()).backward()
        grads = [t.grad for t in leaves] + ([h0.grad] if h0 is not None else [])
        assert_close(o.detach(), res["o"], **tol, what=f"op case {i} output")
        assert_close(s.detach(), res["state"], **tol, what=f"op case {i} state")
        for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], grads, res["grads"]):
            assert_close(a, b, **tol, what=f"op case {i} d{name}")

    lay = fla["layer"]
    with torch.no_grad():
        assert_close(gdn(data["x_short"])[0], lay["short"], **tol, what="layer T=20 (fused_recurrent)")
        assert_close(gdn(data["x_long"])[0], lay["long"], **tol, what="layer T=70 (chunk)")
        padded = gdn(x_padded, linear_attention_mask=mask)[0]
        valid = mask.bool()
        assert_close(padded[valid], lay["padded"][valid], **tol, what="layer, left-padded batch")
    gdn.train()
    x = data["x_long"].clone().requires_grad_(True)
    y = gdn(x)[0]
    (y * data["wy"]).sum().backward()
    assert_close(y.detach(), lay["long_grad_y"], **tol, what="layer forward with grad (chunk)")
    assert_close(x.grad, lay["x_grad"], **tol, what="layer dx")
    for name, p in gdn.named_parameters():
        assert_close(p.grad, lay["param_grads"][name], atol=1e-4, rtol=1e-3, what=f"layer d{name}")


def test_fla_kernel_inputs_follow_autocast():
    """Under bf16-mixed (autocast) fla's kernel gets bfloat16 q, k, v and beta, like the matmuls around it; without
    autocast they pass unchanged (the CPU path computes in float32 either way)."""
    from tcal.student.gdn import kernel_inputs

    q, k, v, beta = (torch.randn(1, 4, 2, 8) for _ in range(4))
    assert all(out is t for out, t in zip(kernel_inputs(q, k, v, beta), (q, k, v, beta)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = kernel_inputs(q, k, v, beta)
    assert [t.dtype for t in cast] == [torch.bfloat16] * 4
    assert torch.equal(cast[0], q.to(torch.bfloat16))
