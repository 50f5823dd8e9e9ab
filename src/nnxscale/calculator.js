// The cost model of nnxscale.costs, in the browser: the same formulas, on the same constants,
// which nnxscale.calculator writes into the page (SPEC). A browser test compares this
// file's answers with the library's over a grid of inputs.
(function () {
  "use strict";

  function counts(cfg) {
    const e = cfg.embed, v = cfg.vocab;
    const attention = 4 * e * cfg.heads * cfg.head_dim;
    const mlp = 2 * e * cfg.mlp;
    const blocks = cfg.layers * (attention + mlp + 2 * e);
    return {
      total: v * e + cfg.max_len * e + blocks + e + e * v,
      tensor: 2 * v * e + cfg.layers * (attention + mlp),
      blocks: blocks,
      matmul: cfg.layers * (attention + mlp) + e * v,
      blocks_matmul: cfg.layers * (attention + mlp),
    };
  }

  function held(cfg, split, mesh) {
    const c = counts(cfg);
    const d = mesh.data || 1, t = mesh.model || 1, p = mesh.stage || 1;
    const other = c.total - c.tensor;
    return {
      whole: c.total,
      data: c.total / d,
      model: c.tensor / t + other,
      "data+model": (c.tensor / t + other) / d,
      stage: c.blocks / p + c.total - c.blocks,
    }[split];
  }

  function layerValues(cfg, seq, model) {
    const split = 4 * cfg.heads * cfg.head_dim + 2 * cfg.mlp + cfg.heads * seq;
    return 4 * cfg.embed + split / model;
  }

  function activationBytes(spec, cfg, sequences, seq, model, remat) {
    const tokens = sequences * seq;
    const width = spec.dtypes[cfg.compute_dtype];
    const layer = tokens * layerValues(cfg, seq, model) * width;
    const head = tokens * (2 * cfg.embed * width + (cfg.vocab / model) * spec.constants.LOGIT_BYTES);
    if (remat) return cfg.layers * tokens * cfg.embed * width + layer + head;
    return cfg.layers * layer + head;
  }

  function stepFlops(cfg, sequences, seq, remat) {
    const c = counts(cfg);
    const tokens = sequences * seq;
    const attention = 4 * cfg.layers * sequences * seq * seq * cfg.heads * cfg.head_dim;
    let total = 3 * (2 * c.matmul * tokens + attention);
    if (remat) {
      const last = cfg.layers * cfg.mlp * cfg.embed;
      total += 2 * (c.blocks_matmul - last) * tokens + attention;
    }
    return total;
  }

  function ringBytes(kind, nbytes, n) {
    if (kind === "collective-permute") return nbytes;
    const factor = kind === "all-reduce" ? (2 * (n - 1)) / n : (n - 1) / n;
    return factor * nbytes;
  }

  function transfers(spec, cfg, strategy, mesh, sequences, seq) {
    const c = counts(cfg);
    const full = c.total * spec.constants.STATE_BYTES;
    const d = mesh.data || 1;
    const width = spec.dtypes[cfg.compute_dtype];
    const perReplica = (sequences * seq) / (d * (mesh.replica || 1));
    const activation = perReplica * cfg.embed * width;
    const tp = held(cfg, "model", mesh) * spec.constants.STATE_BYTES;
    const L = cfg.layers;
    const x = (kind, axis, bytes, count) => ({ kind, axis, array_bytes: bytes, count });
    if (strategy === "DP") return [x("all-reduce", "data", full, 1)];
    if (strategy === "ZeRO-1" || strategy === "ZeRO-2")
      return [x("reduce-scatter", "data", full, 1), x("all-gather", "data", full, 1)];
    if (strategy === "FSDP" || strategy === "HSDP") {
      const out = [x("all-gather", "data", 2 * full, 2 * L), x("reduce-scatter", "data", full, L)];
      if (strategy === "HSDP") out.push(x("all-reduce", "replica", full / d, 1));
      return out;
    }
    if (strategy === "TP" || strategy === "FSDP+TP") {
      const acts = x("all-reduce", "model", (4 * L + 2) * activation, 4 * L + 2);
      if (strategy === "TP") return [acts, x("all-reduce", "data", tp, 1)];
      return [acts, x("all-gather", "data", 2 * tp, 2 * L), x("reduce-scatter", "data", tp, L)];
    }
    const stages = mesh.stage || 1;
    const boundaries = 2 * sequences * seq * cfg.embed * width;
    return [x("collective-permute", "stage", stages > 1 ? boundaries : 0, 2)];
  }

  function gcd(a, b) {
    while (b) [a, b] = [b, a % b];
    return a;
  }

  function meshFor(spec, strategy, devices, hw) {
    const rules = spec.strategies[strategy];
    if (strategy === "HSDP") {
      const replica = Math.max(1, gcd(devices, Math.max(1, Math.floor(devices / hw.domain))));
      return { replica: replica, data: devices / replica };
    }
    let left = devices;
    const shape = rules.sizes.slice();
    rules.sizes.forEach((size, i) => {
      if (size > 0) {
        let k = 1;
        for (let j = 1; j <= Math.min(size, left); j++) if (left % j === 0) k = j;
        shape[i] = k;
        left = left / k;
      }
    });
    shape[rules.sizes.indexOf(-1)] = left;
    const mesh = {};
    rules.axes.forEach((axis, i) => (mesh[axis] = shape[i]));
    return mesh;
  }

  function linkBandwidth(axis, mesh, hw) {
    const names = Object.keys(mesh);
    let span = 1;
    for (const a of names.slice(names.indexOf(axis))) span *= mesh[a];
    return span <= hw.domain ? hw.fast : hw.slow;
  }

  function stepCost(spec, cfg, strategy, devices, hw, sequences, seq, remat) {
    const mesh = meshFor(spec, strategy, devices, hw);
    const [ps, gs, os] = spec.splits[strategy];
    const t = mesh.model || 1, p = mesh.stage || 1;
    const batchSplit = (mesh.data || 1) * (mesh.replica || 1);
    let bubble = 0, inFlight = sequences / batchSplit, cfgHeld = cfg;
    if (strategy === "PP") {
      const m = 4 * p;
      bubble = (p - 1) / (m + p - 1);
      inFlight = (Math.min(p, m) * sequences) / m;
      cfgHeld = Object.assign({}, cfg, { layers: Math.ceil(cfg.layers / p) });
    }
    const k = spec.constants;
    const memory = {
      parameters: held(cfg, ps, mesh) * k.STATE_BYTES,
      gradients: held(cfg, gs, mesh) * k.STATE_BYTES,
      "optimizer state": held(cfg, os, mesh) * k.STATE_BYTES * k.OPTIMIZER_COPIES,
      activations: activationBytes(spec, cfgHeld, inFlight, seq, t, remat),
    };
    const flops = stepFlops(cfg, sequences, seq, remat) / devices;
    const moves = transfers(spec, cfg, strategy, mesh, sequences, seq);
    const sent = moves.reduce((s, x) => s + ringBytes(x.kind, x.array_bytes, mesh[x.axis]), 0);
    const compute = flops / (hw.flops * k.EFFICIENCY) / (1 - bubble);
    let comm = 0;
    for (const x of moves) {
      if (mesh[x.axis] > 1)
        comm += k.LATENCY * x.count + ringBytes(x.kind, x.array_bytes, mesh[x.axis]) / linkBandwidth(x.axis, mesh, hw);
    }
    const total = Object.values(memory).reduce((a, b) => a + b, 0);
    return {
      mesh, memory, total_memory: total, flops, sent, compute_time: compute, comm_time: comm,
      bubble, step_time: Math.max(compute, comm), params: counts(cfg).total,
    };
  }

  const COLORS = {
    parameters: "#4c72b0", gradients: "#dd8452", "optimizer state": "#55a868", activations: "#c44e52",
  };

  function gb(x) {
    return (x / 1e9).toFixed(2) + " GB";
  }

  function setUp(root) {
    const spec = JSON.parse(root.querySelector("script[type='application/json']").textContent);
    const form = root.querySelector("form");
    const out = root.querySelector(".nnxscale-calc-out");
    const read = () => {
      const v = (name) => form.elements[name].value;
      const n = (name) => Number(v(name));
      return {
        cfg: {
          vocab: n("vocab"), embed: n("embed"), heads: n("heads"), head_dim: n("head_dim"),
          mlp: n("mlp"), layers: n("layers"), max_len: n("seq"), compute_dtype: v("dtype"),
        },
        strategy: v("strategy"), devices: n("devices"), hardware: v("hardware"),
        sequences: n("batch"), seq: n("seq"), remat: form.elements.remat.checked,
      };
    };
    const render = () => {
      const input = read();
      const hw = spec.hardware.find((h) => h.name === input.hardware);
      const r = stepCost(spec, input.cfg, input.strategy, input.devices, hw, input.sequences, input.seq, input.remat);
      const scale = Math.max(r.total_memory, hw.memory);
      const bar = Object.entries(r.memory).map(([k, b]) =>
        `<span title="${k}" style="display:inline-block;height:1.2rem;background:${COLORS[k]};width:${(100 * b) / scale}%"></span>`
      ).join("");
      const rows = [
        ["parameter count", (r.params / 1e9).toFixed(3) + " billion", r.params],
        ["mesh", Object.entries(r.mesh).map(([a, s]) => `${a} ${s}`).join(" x "), ""],
        ...Object.entries(r.memory).map(([k, b]) => [k, gb(b), b]),
        ["memory per device", `${gb(r.total_memory)} of ${gb(hw.memory)}` + (r.total_memory > hw.memory ? " (does not fit)" : ""), r.total_memory],
        ["bytes sent per device", gb(r.sent), r.sent],
        ["FLOPs per device", r.flops.toExponential(3), r.flops],
        ["compute time", r.compute_time.toFixed(4) + " s", r.compute_time],
        ["communication time", r.comm_time.toFixed(4) + " s", r.comm_time],
        ["predicted step time", r.step_time.toFixed(4) + " s (" + (r.compute_time >= r.comm_time ? "compute" : "communication") + "-bound)", r.step_time],
      ];
      out.innerHTML =
        `<div class="nnxscale-calc-bar" role="img" aria-label="memory per device by component">${bar}` +
        `<span class="nnxscale-calc-limit" style="left:${(100 * hw.memory) / scale}%"></span></div>` +
        `<div class="nnxscale-calc-legend">` +
        Object.keys(COLORS).map((k) => `<span><i style="background:${COLORS[k]}"></i>${k}</span>`).join("") +
        `<span>dashed line: the device's memory</span></div><table class="nnxscale-calc-table"><tbody>` +
        rows.map(([k, text, value]) => `<tr><th>${k}</th><td data-field="${k}" data-value="${value}">${text}</td></tr>`).join("") +
        `</tbody></table>`;
    };
    form.addEventListener("input", render);
    form.addEventListener("change", render);
    render();
  }

  window.nnxscaleCalculator = { stepCost, counts };
  document.querySelectorAll(".nnxscale-calc:not([data-ready])").forEach((root) => {
    root.setAttribute("data-ready", "1");
    setUp(root);
  });
})();
