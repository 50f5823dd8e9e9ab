// The cost model of nnxscale.costs, in the browser. The library writes into the page, for
// every rule set the planner considers and each memory ledger, the formulas it derives from
// that rule set (SPEC); this script evaluates them and repeats only step_cost's arithmetic
// rules: the moments that can be a step's peak, the precision's bytes, the link a
// collective crosses and the lane it shares, what compute hides, the host's launches, and a
// pipeline's bubble on its schedule. A browser test compares its answers with the library's.
(function () {
  "use strict";

  // A formula is a list of [coefficient, {size: power}] terms.
  function evaluate(formula, sizes) {
    let total = 0;
    for (const [coefficient, powers] of formula) {
      let term = coefficient;
      for (const [name, power] of Object.entries(powers)) term *= Math.pow(sizes[name], power);
      total += term;
    }
    return total;
  }

  function product(values) {
    return values.reduce((a, b) => a * b, 1);
  }

  // nnxscale.calculator.setup_for
  function meshFor(spec, strategy, devices, degrees) {
    const s = spec.strategies[strategy];
    const sizes = {};
    if (s.axes.length > 1) {
      for (const axis of s.used) if (axis in spec.degrees) sizes[axis] = degrees[spec.degrees[axis]];
    }
    const rest = s.used.filter((a) => !(a in sizes));
    const fixed = product(Object.values(sizes));
    if (rest.length) sizes[rest[0]] = devices % fixed === 0 ? devices / fixed : 0;
    const mesh = {};
    for (const axis of s.axes) mesh[axis] = sizes[axis] || (axis in sizes ? 0 : 1);
    return product(Object.values(mesh)) === devices ? mesh : null;
  }

  // nnxscale.Config: what it refuses of the sizes and the mixture (config_problem)
  function mixtureProblem(cfg) {
    if (!(cfg.kv_heads >= 1) || cfg.heads % cfg.kv_heads) return `kv_heads=${cfg.kv_heads} does not divide heads=${cfg.heads}: each key/value head serves a whole group of query heads`;
    if (cfg.experts < 0) return `experts=${cfg.experts}: use 0 for a dense MLP or a positive number of experts`;
    if (cfg.experts && !(1 <= cfg.top_k && cfg.top_k <= cfg.experts)) return `top_k=${cfg.top_k} with ${cfg.experts} experts: use 1 <= top_k <= ${cfg.experts}`;
    if (cfg.experts && !(cfg.capacity_factor > 0)) return "the capacity factor must be positive";
    return "";
  }

  // nnxscale.costs.unsuitable (after the mixture's checks)
  function unsuitable(c, sizes, mesh, batch, seq, micro, layers, virtual, schedule, remat) {
    for (const [size, axes] of c.splits) {
      const n = product(axes.map((a) => mesh[a]));
      if (sizes[size] % n && size !== "layers") return `the ${axes.join("x")} axis (${n}) does not divide ${size} (${sizes[size]})`;
    }
    const split = product(c.batch_axes.map((a) => mesh[a]));
    if (batch % (split * micro)) return `the batch of ${batch} sequences does not split into ${micro} micro-batches x ${split} devices`;
    const ring = c.ring_axis ? mesh[c.ring_axis] : 1;
    if (c.ring_axis && ring < 2) return `a context ring needs 2 or more devices on '${c.ring_axis}', not ${ring}`;
    if (seq % (2 * ring)) return `${seq} tokens do not cut into 2 x ${ring} chunks for the zig-zag ring`;
    const stages = c.stage_axis ? mesh[c.stage_axis] : 1;
    if (micro < stages && schedule !== "1F1B") return `${stages} stages need at least ${stages} micro-batches on the ${schedule} schedule (1F1B runs fewer, idling (p - 1) / (m + p - 1) of its step)`;
    if (schedule.startsWith("ZB") && remat === "full") return `${schedule} defers each W, which reads its products' inputs kept from B; full remat rebuilds them inside B and would hold them until W: use remat='dots' or none`;
    if (schedule === "ZB-V" && micro < 2 * stages - 1) return `ZB-V on ${stages} stages fills its V with 2p - 1 = ${2 * stages - 1} micro-batches, not ${micro}: use more, or 1F1B or ZB-H1`;
    if (schedule === "1F1B" && virtual > 1 && micro % stages) return `interleaved 1F1B needs micro-batches (${micro}) a multiple of the stages (${stages})`;
    if (layers < stages * virtual) return `${layers} layers do not fill ${stages} stages x ${virtual} virtual stages`;
    return "";
  }

  // nnxscale.costs.memory_phases: every gradient scaled by the precision's width (g)
  function phases(c, sizes, micro, g) {
    const f = (name) => evaluate(c[name], sizes);
    if (c.stage_axis && c.schedule === "lockstep") return { "a backward task": f("activations") + f("rebuilt") + f("weights") + f("head") + g * f("gradients") };
    const accumulate = micro > 1 ? g * f("accumulator") : 0;
    const weights = f("weights") + accumulate;
    const kept = f("activations") + weights + g * f("head_gradients");
    const found = {
      "backward starts": kept + f("head"),
      "a layer's backward": kept + f("rebuilt") + g * f("layer_gradients"),
      update: c.in_place ? g * f("gradients") : 2 * g * f("gradients") + accumulate,
    };
    if (!c.stage_axis) return found;
    return { // one program per stage: its first and its last
      "the first stage's backward starts": f("activations") + weights,
      "the last stage's backward starts": f("last_stage") + f("head") + g * f("head_gradients") + weights,
      "a layer's backward": found["a layer's backward"],
      update: found.update,
    };
  }

  // nnxscale.costs.state_bytes: the book's state scaled to the precision's bytes
  function stateBytes(spec, c, sizes, precision) {
    const book = spec.constants.BOOK;
    const optimizer = (p) => p.master + p.moments + p.ema;
    return {
      parameters: (evaluate(c.state.parameters, sizes) * precision.parameters) / book.parameters,
      "optimizer state": (evaluate(c.state["optimizer state"], sizes) * optimizer(precision)) / optimizer(book),
    };
  }

  // nnxscale.costs.within, link and collective_seconds
  function within(axes, mesh, hw) {
    const names = Object.keys(mesh);
    const first = Math.min(...axes.map((a) => names.indexOf(a)));
    return product(names.slice(first).map((a) => mesh[a])) <= hw.domain;
  }

  // nnxscale.costs.members
  function members(axes, mesh, hw) {
    const names = Object.keys(mesh);
    let found = 1;
    for (const a of axes) {
      const stride = product(names.slice(names.indexOf(a) + 1).map((b) => mesh[b]));
      found *= Math.min(mesh[a], Math.max(1, Math.floor(hw.domain / stride)));
    }
    return found;
  }

  function link(axes, mesh, hw, rails = true) {
    if (!within(axes, mesh, hw)) return [Math.min(hw.fast, (rails ? members(axes, mesh, hw) : 1) * hw.slow), hw.far_hop];
    const n = product(axes.map((a) => mesh[a]));
    const line = hw.wrap > 0 && n % hw.wrap !== 0;
    return [line ? hw.fast / 2 : hw.fast, hw.hop];
  }

  function collectiveSeconds(kind, array, n, mesh, axes, hw) {
    const [bandwidth, hop] = link(axes, mesh, hw, kind !== "collective-permute");
    const ring = hw.ring && within(axes, mesh, hw);
    const steps = kind === "all-reduce" ? 2 * (n - 1) : kind === "collective-permute" ? 1 : n - 1;
    let sent, moved;
    if (kind === "all-to-all") {
      sent = ((n - 1) / n) * array;
      moved = ring ? (n * array * ((n - 1) / n)) / 4 : sent;
    } else {
      sent = kind === "collective-permute" ? array : kind === "all-reduce" ? ((2 * (n - 1)) / n) * array : ((n - 1) / n) * array;
      moved = sent;
    }
    return [sent, steps * hop + moved / bandwidth];
  }

  // nnxscale.activations.mixture and nnxscale.costs.model_sizes
  function mlpKind(cfg) {
    return cfg.experts ? Math.min(cfg.top_k, 2) : 0;
  }

  function modelSizes(spec, cfg, seq) {
    const sizes = {};
    for (const name of ["vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "experts", "top_k"]) sizes[name] = cfg[name];
    sizes.max_len = seq;
    sizes.block = Math.min(seq, spec.constants.BLOCK);
    sizes.capacity = cfg.experts ? Math.max(1, Math.ceil((cfg.capacity_factor * cfg.top_k * seq) / cfg.experts)) : 0;
    return sizes;
  }

  // nnxscale.costs.lanes: the lane of each [axes, where]; on a torus each axis has its own
  // links, unless there are more groups of axes than the torus has dimensions
  function lanes(collectives, torus, dimensions) {
    let groups = [];
    const onTorus = (where) => torus && where === "fast";
    for (const [axes, where] of collectives) {
      if (!onTorus(where)) continue;
      const meets = (g) => axes.some((a) => g.has(a));
      const joined = new Set(axes);
      for (const g of groups.filter(meets)) for (const a of g) joined.add(a);
      groups = groups.filter((g) => ![...g].some((a) => joined.has(a))).concat([joined]);
    }
    const crowded = dimensions > 0 && groups.length > dimensions;
    return collectives.map(([axes, where]) => {
      if (!onTorus(where) || crowded) return where;
      const group = groups.find((g) => axes.some((a) => g.has(a)));
      return "fast: " + [...group].sort().join(" x ");
    });
  }

  // nnxscale.costs.hide: the collectives of one lane that compute can hide, [seconds, overlap, pieces] each
  function hide(group, window) {
    const sum = (k) => group.filter(([, o]) => o === k).reduce((a, [s]) => a + s, 0);
    const total = group.reduce((a, [s]) => a + s, 0);
    if (!total) return 0;
    const excess = Math.max(0, total - window.gather, sum("reduce") - window.reduce, sum("ring") - window.ring);
    const first = group.reduce((a, [s, , p]) => a + s / Math.max(1, p), 0);
    return Math.min(total, excess + first);
  }

  // nnxscale.costs.hardware.shared: the share of memory a plan under the ledger may fill
  function shared(spec, hw, ledger) {
    return ledger === "program" ? hw.usable : Math.max(hw.usable, spec.constants.TUNED_SHARE);
  }

  // nnxscale.costs.step_cost
  function stepCost(spec, cfg, strategy, remat, hw, devices, degrees, batch, seq, micro, schedule = "lockstep", virtual = 1, ledger = "fused", precisionName = null) {
    const mesh = meshFor(spec, strategy, devices, degrees);
    if (!mesh) return { reason: `the degrees do not divide ${devices} devices` };
    const s = spec.strategies[strategy];
    const precision = spec.precisions[precisionName] || spec.constants.BOOK;
    const forms = s.ledgers[ledger];
    // nnxscale.calculator.setup_for: a pipeline on its schedule, the others on none
    const pipeline = Object.keys(forms.one_f_one_b).length > 0 || s.unledgered !== "";
    const f1b = pipeline && schedule !== "lockstep";
    const sched = f1b ? schedule : "lockstep";
    const policy = pipeline && !f1b ? "no" : remat; // the lockstep executor rebuilds its stages
    // nnxscale.costs.Setup.of: ZB-V runs two stages a device (its V), ZB-H1 one
    const v = !f1b ? 1 : sched === "ZB-V" && (virtual === 1 || virtual === 2) ? 2 : virtual;
    if (!(Number.isInteger(v) && v >= 1) || (v > 1 && sched !== "1F1B" && sched !== "ZB-V")) {
      return { reason: `virtual=${v}: virtual stages are a positive integer, more than one only for the 1F1B schedule (interleaved 1F1B; ZB-V always runs two)`, mesh };
    }
    const kind = String(mlpKind(cfg));
    const tables = f1b ? forms.one_f_one_b : forms.mlp;
    const unpriced = s.unpriced[f1b ? "1F1B" : "lockstep"][kind];
    const problem = mixtureProblem(cfg) || (kind in tables ? "" : unpriced || s.unledgered);
    if (problem) return { reason: problem, mesh };
    const table = tables[kind];
    const c = table[policy in table ? policy : Object.keys(table)[0]];
    const sizes = Object.assign(modelSizes(spec, cfg, seq), { batch, seq, micro, virtual: v, interleaved: v > 1 && sched === "1F1B" ? 1 : 0 }, mesh);
    // nnxscale.costs.counts._padded: the busiest stage's layers, times the stages and virtual stages
    const stages = c.stage_axis ? mesh[c.stage_axis] : 1;
    sizes.layers = Math.ceil(cfg.layers / (stages * v)) * stages * v;
    sizes.flight = Math.min(stages, micro);
    const reason = unsuitable(c, sizes, mesh, batch, seq, micro, cfg.layers, v, sched, policy);
    if (reason) return { reason, mesh };
    const g = precision.gradients / spec.constants.STATE_BYTES;
    const memory = stateBytes(spec, c, sizes, precision);
    const found = phases(c, sizes, micro, g);
    memory["working memory"] = Math.max(...Object.values(found));
    const flops = evaluate(c.flops, sizes);
    const state = Object.keys(c.state).reduce((a, k) => a + memory[k], 0);
    // nnxscale.costs.compute_seconds: products at the efficiency, flash attention at its own
    // share, the traffic through memory; no faster than the host launches the layers
    const traffic = 2 * evaluate(c.activations, sizes) + 3 * evaluate(c.weights, sizes) + 3 * state;
    const attention = hw.attention ? evaluate(c.attention_flops, sizes) : 0;
    const launched = (sizes.layers / stages) * micro * (policy === "full" ? 1.5 : 1);
    let compute = Math.max(
      (flops - attention) / (hw.flops * hw.efficiency) + attention / (hw.flops * (hw.attention || 1)) + traffic / hw.hbm,
      hw.launch * launched,
    );
    const forward = (compute * evaluate(c.forward_flops, sizes)) / flops;
    const once = c.stage_axis ? micro : 1; // a pipeline reduces after its last micro-batch
    const window = { gather: compute, reduce: (compute - forward) / once, ring: (compute * evaluate(c.attention_flops, sizes)) / flops };
    const widths = { gradients: g, "updated parameters": precision.parameters / spec.constants.STATE_BYTES };
    let sent = 0, seconds = 0, exposed = 0;
    const crossing = c.transfers.filter((t) => product(t.axes.map((a) => mesh[a])) > 1);
    const where = crossing.map((t) => [t.axes, within(t.axes, mesh, hw) ? "fast" : "slow"]);
    const lane = lanes(where, hw.ring, hw.dimensions);
    const links = {}, busy = {};
    crossing.forEach((t, i) => {
      const n = product(t.axes.map((a) => mesh[a]));
      const passes = evaluate(t.passes, sizes);
      const array = evaluate(t.array, sizes) * (widths[t.what] ?? 1);
      let [s, time] = collectiveSeconds(t.kind, array, n, mesh, t.axes, hw);
      const hidden = spec.constants.HIDDEN.includes(t.overlap);
      if (!hidden) time += hw.sync; // each waits for every device of its group
      sent += passes * s;
      seconds += passes * time;
      busy[lane[i]] = (busy[lane[i]] || 0) + passes * time;
      if (!hidden) exposed += passes * time;
      else (links[lane[i]] = links[lane[i]] || []).push([passes * time, t.overlap, evaluate(t.launches, sizes)]);
    });
    for (const group of Object.values(links)) exposed += hide(group, window);
    const busiest = Math.max(0, ...Object.values(busy));
    let bubble = 0;
    if (c.stage_axis) { // nnxscale.costs.pipeline_bubble
      const p = mesh[c.stage_axis];
      bubble = { "1F1B": (p - 1) / (v * micro + p - 1), "ZB-H1": (p - 1) / (3 * micro + p - 1), "ZB-V": (p - 1) / (6 * micro + p - 1) }[sched] ?? 1 - micro / (1.5 * (micro + p - 1));
      compute = compute / (1 - bubble);
    }
    const peak = Object.values(memory).reduce((a, b) => a + b, 0);
    const step = compute + exposed;
    return {
      mesh, memory, peak, flops, sent, comm_time: seconds, exposed, compute_time: compute, bubble, step_time: step,
      params: evaluate(spec.parameters[kind], sizes) / spec.constants.STATE_BYTES,
      bound: busiest > compute ? "communication" : "compute",
      usable: hw.memory * shared(spec, hw, ledger),
    };
  }

  const COLORS = { parameters: "#4c72b0", "optimizer state": "#55a868", "working memory": "#c44e52" };

  function gb(x) {
    return (x / 1e9).toFixed(2) + " GB";
  }

  function setUp(root) {
    const spec = JSON.parse(root.querySelector("script[type='application/json']").textContent);
    const form = root.querySelector("form");
    const out = root.querySelector(".nnxscale-calc-out");
    const n = (name) => Number(form.elements[name].value);
    const render = () => {
      const cfg = {};
      for (const name of ["vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "experts", "top_k", "capacity_factor"]) cfg[name] = n(name);
      const hw = spec.hardware.find((h) => h.name === form.elements.hardware.value);
      const degrees = {};
      for (const name of Object.values(spec.degrees)) degrees[name] = n(name);
      const ledger = form.elements.ledger.value;
      const r = stepCost(spec, cfg, form.elements.strategy.value, form.elements.remat.value, hw, n("devices"), degrees, n("batch"), n("seq"), n("micro"), form.elements.schedule.value, n("virtual"), ledger, form.elements.precision.value);
      if (r.reason) {
        out.innerHTML = `<p data-field="verdict">cannot run: ${r.reason}</p>`;
        return;
      }
      const usable = r.usable; // JAX's default share for the program, a tuned trainer's for the fused ledger
      const share = usable / hw.memory;
      const limit = usable / spec.constants.HEADROOM;
      const scale = Math.max(r.peak, hw.memory);
      const bar = Object.entries(r.memory).map(([k, b]) =>
        `<span title="${k}" style="display:inline-block;height:1.2rem;background:${COLORS[k]};width:${(100 * b) / scale}%"></span>`
      ).join("");
      const fits = r.peak <= limit;
      const rows = [
        ["parameter count", (r.params / 1e9).toFixed(3) + " billion", r.params],
        ["mesh", Object.entries(r.mesh).filter(([, s]) => s > 1).map(([a, s]) => `${a} ${s}`).join(" x ") || "one device", ""],
        ...Object.entries(r.memory).map(([k, b]) => [k, gb(b), b]),
        ["peak per device", `${gb(r.peak)}: ${fits ? "fits" : "does not fit"} (x ${spec.constants.HEADROOM} headroom, of ${gb(usable)}${share < 1 ? `, ${ledger === "program" ? "JAX's default" : "a tuned trainer's"} ${Math.round(100 * share)}% of ${gb(hw.memory)}` : ""})`, r.peak],
        ["memory ledger", spec.ledgers[ledger], ""],
        ["bytes sent per device", gb(r.sent), r.sent],
        ["FLOPs per device", r.flops.toExponential(3), r.flops],
        ["compute time", r.compute_time.toFixed(4) + " s", r.compute_time],
        ["communication time", r.comm_time.toFixed(4) + " s", r.comm_time],
        ["exposed communication", r.exposed.toFixed(4) + " s", r.exposed],
        ["predicted step time", `${r.step_time.toFixed(4)} s (${r.bound}-bound)`, r.step_time],
      ];
      out.innerHTML =
        `<div class="nnxscale-calc-bar" role="img" aria-label="memory per device by component">${bar}` +
        `<span class="nnxscale-calc-limit" style="left:${(100 * limit) / scale}%"></span></div>` +
        `<div class="nnxscale-calc-legend">` +
        Object.keys(COLORS).map((k) => `<span><i style="background:${COLORS[k]}"></i>${k}</span>`).join("") +
        `<span>dashed line: the memory arrays get, less the headroom</span></div><table class="nnxscale-calc-table"><tbody>` +
        rows.map(([k, text, value]) => `<tr><th>${k}</th><td data-field="${k}" data-value="${value}">${text}</td></tr>`).join("") +
        `</tbody></table>`;
    };
    form.addEventListener("input", render);
    form.addEventListener("change", render);
    render();
  }

  window.nnxscaleCalculator = { stepCost, evaluate };
  document.querySelectorAll(".nnxscale-calc:not([data-ready])").forEach((root) => {
    root.setAttribute("data-ready", "1");
    setUp(root);
  });
})();
