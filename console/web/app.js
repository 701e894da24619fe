// The Loom console: one page, hash-routed, that reads and writes only through the REST API
// with the user's bearer token (kept in sessionStorage, sent as a header; no cookies). Every
// string from the API goes into the page as text, never as markup.
'use strict';
(() => {
  const TOKEN_KEY = 'loom.token';
  const POLL_MS = 2000;
  const STATES = ['queued', 'scheduled', 'running', 'retrying', 'succeeded', 'failed', 'cancelled'];
  const TERMINAL = new Set(['succeeded', 'failed', 'cancelled']);
  const KINDS = ['pretrain', 'sft', 'eval'];
  const COLORS = ['#2563eb', '#dc2626', '#16a34a', '#9333ea', '#ea580c', '#0891b2', '#4d7c0f'];
  const main = document.getElementById('main');
  const statusLine = document.getElementById('status');
  // What tests and curious users can read back: the charts with their data.
  const exposed = (window.loomConsole = { charts: {} });
  let cleanups = [];

  // ---- DOM -------------------------------------------------------------------------------
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'class') el.className = v;
      else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? '' : String(v));
    }
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }
  const svgNS = 'http://www.w3.org/2000/svg';
  function s(tag, attrs, ...children) {
    const el = document.createElementNS(svgNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
    for (const c of children.flat()) el.append(c instanceof Node ? c : document.createTextNode(c));
    return el;
  }
  function table(headers, rows, caption) {
    return h('div', { class: 'table-wrap' },
      h('table', {},
        caption ? h('caption', {}, caption) : null,
        h('thead', {}, h('tr', {}, headers.map((x) => h('th', { scope: 'col' }, x)))),
        h('tbody', {}, rows)));
  }
  function say(text, isError) {
    statusLine.textContent = text;
    statusLine.className = isError ? 'error' : '';
  }
  const jobLink = (id, text) => h('a', { href: `#/jobs/${encodeURIComponent(id)}` }, text || id);
  const badge = (state) => h('span', { class: `badge state-${state}` }, state);

  // ---- formatting ------------------------------------------------------------------------
  const num = (x) => (typeof x === 'number' ? x : Number(x)); // int64 arrives as a string
  function fmt(x, digits = 4, expDigits = 2) {
    const v = num(x);
    if (!Number.isFinite(v)) return x === undefined ? '' : String(x);
    if (v !== 0 && (Math.abs(v) >= 1e5 || Math.abs(v) < 1e-3)) return v.toExponential(expDigits);
    return String(Number(v.toPrecision(digits)));
  }
  // Axis tick labels with the fewest significant digits that write every tick exactly (0.25, not
  // 0.3) and so tell them apart (two ticks of a learning-rate axis must not both read "0.001").
  function tickLabels(splits) {
    const scale = Math.max(...splits.map((v) => Math.abs(v || 0)));
    for (let digits = 1; digits <= 8; digits++) {
      const labels = splits.map((v) => (v == null ? '' : fmt(v, digits, digits - 1)));
      const exact = splits.every((v, i) => v == null || Math.abs(Number(labels[i]) - v) <= 1e-9 * scale);
      if (exact && new Set(labels.filter(Boolean)).size === labels.filter(Boolean).length) return labels;
    }
    return splits.map((v) => (v == null ? '' : String(v)));
  }
  function fmtTime(ms) {
    const v = num(ms);
    if (!v) return '';
    const d = new Date(v);
    const p = (n) => String(n).padStart(2, '0');
    return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ` +
      `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
  }
  function fmtAge(ms) {
    const v = num(ms);
    if (!v) return 'never';
    const s = Math.max(0, Math.round((Date.now() - v) / 1000));
    return s < 120 ? `${s} s ago` : s < 7200 ? `${Math.round(s / 60)} min ago` : fmtTime(v);
  }
  const finite = (x) => (Number.isFinite(num(x)) ? num(x) : null);

  // ---- API -------------------------------------------------------------------------------
  const token = () => sessionStorage.getItem(TOKEN_KEY) || '';
  class ApiError extends Error {
    constructor(status, message, fields) {
      super(message);
      this.status = status;
      this.fields = fields || [];
    }
  }
  async function api(method, path, body, signal) {
    const headers = { Authorization: `Bearer ${token()}` };
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    const res = await fetch(path, {
      method, headers, signal, cache: 'no-store',
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await res.text();
    let json = null;
    try { json = text ? JSON.parse(text) : null; } catch (e) { json = null; }
    if (!res.ok) {
      const err = (json && json.error) || {};
      const fields = (err.details || []).flatMap((d) => d.fieldViolations || []);
      if (res.status === 401 && !path.startsWith('/v1/jobs?page_size=1&')) {
        sessionStorage.removeItem(TOKEN_KEY);
        location.hash = '#/login';
      }
      throw new ApiError(res.status, err.message || text || res.statusText, fields);
    }
    return json;
  }
  // Every page of a list (bounded: a console is not an export tool).
  async function all(path, key, pages = 20) {
    const out = [];
    let pageToken = '';
    for (let i = 0; i < pages; i++) {
      const sep = path.includes('?') ? '&' : '?';
      const r = await api('GET', `${path}${sep}page_size=500` +
        (pageToken ? `&page_token=${encodeURIComponent(pageToken)}` : ''));
      out.push(...(r[key] || []));
      pageToken = r.next_page_token || '';
      if (!pageToken) break;
    }
    return out;
  }

  // ---- views' lifetime -------------------------------------------------------------------
  function onLeave(fn) { cleanups.push(fn); }
  function every(ms, fn) {
    let stopped = false, timer = null;
    const tick = async () => {
      if (stopped) return;
      try { await fn(); } catch (e) { if (!(e instanceof ApiError && e.status === 401)) say(e.message, true); }
      if (!stopped) timer = setTimeout(tick, ms);
    };
    onLeave(() => { stopped = true; clearTimeout(timer); });
    return tick();
  }
  function page(title, ...content) {
    main.replaceChildren(h('h1', { tabindex: '-1', id: 'page-title' }, title), ...content);
    document.title = `${title} · Loom`;
  }
  function params(query) { return new URLSearchParams(query || ''); }

  // ---- login -----------------------------------------------------------------------------
  function viewLogin() {
    const input = h('input', { id: 'token', type: 'password', autocomplete: 'off', required: true,
      'aria-describedby': 'token-help' });
    const error = h('p', { class: 'field-error', id: 'login-error', role: 'alert' });
    const form = h('form', { class: 'card narrow', onsubmit: async (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, input.value.trim());
      try {
        await api('GET', '/v1/jobs?page_size=1&order=desc');
        location.hash = '#/jobs';
      } catch (e) {
        sessionStorage.removeItem(TOKEN_KEY);
        error.textContent = e.message;
      }
    } },
      h('label', { for: 'token' }, 'Bearer token'), input,
      h('p', { id: 'token-help', class: 'help' },
        'A user token from the coordinator\'s --user-tokens file. `loom up` prints a URL that logs ',
        'you in; the token stays in this tab only (sessionStorage).'),
      error, h('button', { type: 'submit' }, 'Log in'));
    page('Log in', form);
  }

  // ---- jobs ------------------------------------------------------------------------------
  function viewJobs(query) {
    const q = params(query);
    const filters = { state: q.get('state') || '', user: q.get('user') || '',
      kind: q.get('kind') || '', sweep: q.get('sweep') || '', label: q.get('label') || '' };
    const tokens = [''];
    let at = 0;
    const setFilter = (k, v) => {
      const next = new URLSearchParams(Object.entries({ ...filters, [k]: v }).filter(([, x]) => x));
      location.hash = `#/jobs${next.toString() ? `?${next}` : ''}`;
    };
    const select = (id, label, value, options) => h('div', { class: 'field' },
      h('label', { for: id }, label),
      h('select', { id, onchange: (e) => setFilter(id.replace('filter-', ''), e.target.value) },
        h('option', { value: '' }, 'any'),
        options.map((o) => h('option', { value: o, selected: o === value }, o))));
    const text = (id, label, value) => h('div', { class: 'field' },
      h('label', { for: id }, label),
      h('input', { id, value, size: 14,
        onchange: (e) => setFilter(id.replace('filter-', ''), e.target.value.trim()) }));
    const tbody = h('tbody');
    const selected = new Set();  // ticked for comparing, across refreshes and pages
    const compare = h('button', { type: 'button', id: 'compare', disabled: true,
      onclick: () => { location.hash = compareHash([...selected], compareSettings(params(''))); } }, 'Compare');
    const toggle = (id, on) => {
      if (on) selected.add(id); else selected.delete(id);
      compare.disabled = !selected.size || selected.size > MAX_COMPARE;
      compare.textContent = !selected.size ? 'Compare' : selected.size > MAX_COMPARE
        ? `Compare (${selected.size}: at most ${MAX_COMPARE})` : `Compare ${selected.size} job${selected.size > 1 ? 's' : ''}`;
    };
    const older = h('button', { type: 'button', onclick: () => { at++; refresh(); } }, 'Older');
    const newer = h('button', { type: 'button', onclick: () => { at--; refresh(); } }, 'Newer');
    const pageInfo = h('span', { class: 'help' });
    const refresh = async () => {
      const p = new URLSearchParams(Object.entries(filters).filter(([, x]) => x));
      p.set('order', 'desc');
      p.set('page_size', '25');
      if (tokens[at]) p.set('page_token', tokens[at]);
      const r = await api('GET', `/v1/jobs?${p}`);
      tokens[at + 1] = r.next_page_token || '';
      older.disabled = !r.next_page_token;
      newer.disabled = at === 0;
      pageInfo.textContent = `page ${at + 1}`;
      tbody.replaceChildren(...(r.jobs || []).map((j) => jobRow(j, selected.has(j.id), toggle)));
      if (!(r.jobs || []).length) tbody.append(h('tr', {}, h('td', { colspan: 10 }, 'No jobs.')));
    };
    page('Jobs',
      h('form', { class: 'filters', onsubmit: (e) => e.preventDefault() },
        select('filter-state', 'State', filters.state, STATES),
        text('filter-user', 'User', filters.user),
        select('filter-kind', 'Kind', filters.kind, KINDS),
        text('filter-sweep', 'Sweep', filters.sweep),
        text('filter-label', 'Labels (k=v,…)', filters.label)),
      h('p', { class: 'compare-bar' }, compare, ' ', h('span', { class: 'help' }, 'Tick jobs to overlay their curves.')),
      h('div', { class: 'table-wrap' }, h('table', { id: 'jobs' },
        h('thead', {}, h('tr', {}, [h('span', { class: 'visually-hidden' }, 'Compare'), 'Job', 'Name', 'Kind',
          'State', 'Progress', 'Loss', 'User', 'Submitted', 'Attempts'].map((x) => h('th', { scope: 'col' }, x)))), tbody)),
      h('div', { class: 'pager' }, newer, pageInfo, older));
    every(POLL_MS, refresh);
  }
  function progressCell(job) {
    const p = job.progress || {};
    const step = num(p.step || 0), total = num(p.total_steps || job.spec?.steps || 0);
    return h('td', { class: 'progress' },
      total ? h('progress', { max: total, value: Math.min(step, total),
        'aria-label': `${job.id} step ${step} of ${total}` }) : null,
      ` ${step}/${total || '?'}`);
  }
  function jobRow(job, ticked, toggle) {
    return h('tr', { 'data-job': job.id },
      h('td', {}, h('input', { type: 'checkbox', class: 'pick', checked: ticked, 'aria-label': `compare ${job.id}`,
        onchange: (e) => toggle(job.id, e.target.checked) })),
      h('td', {}, jobLink(job.id)), h('td', {}, job.name), h('td', {}, job.spec?.kind || 'pretrain'),
      h('td', {}, badge(job.state)), progressCell(job),
      h('td', { class: 'num' }, job.progress && num(job.progress.step) ? fmt(job.progress.loss) : ''),
      h('td', {}, job.submitted_by), h('td', {}, fmtTime(job.submit_time_ms)),
      h('td', { class: 'num' }, `${job.attempt}` + (job.restarts ? ` (${job.restarts} restarts)` : '')));
  }

  // ---- one job ---------------------------------------------------------------------------
  function viewJob(rawId) {
    const id = decodeURIComponent(rawId);
    const head = h('div', { class: 'job-head' });
    const summary = h('dl', { class: 'summary' });
    const spec = h('details', { class: 'spec' }, h('summary', {}, 'Resolved spec'), h('pre', { id: 'spec' }));
    const charts = h('div', { class: 'charts' });
    const evals = h('div');
    const reasoning = h('div');
    const timeline = h('ol', { class: 'timeline', id: 'timeline' });
    const log = h('pre', { id: 'log', class: 'log', tabindex: '0', 'aria-label': 'Job log' });
    const follow = h('input', { type: 'checkbox', id: 'follow', checked: true });
    const logStatus = h('span', { class: 'help', id: 'log-status' });
    page(id, head, summary, spec,
      h('section', { 'aria-labelledby': 'h-curves' }, h('h2', { id: 'h-curves' }, 'Curves'), charts),
      h('section', { 'aria-labelledby': 'h-evals' }, h('h2', { id: 'h-evals' }, 'Evaluations'), evals, reasoning),
      h('section', { 'aria-labelledby': 'h-timeline' }, h('h2', { id: 'h-timeline' }, 'Timeline'), timeline),
      h('section', { 'aria-labelledby': 'h-log' }, h('h2', { id: 'h-log' }, 'Log'),
        h('div', { class: 'log-controls' }, follow, h('label', { for: 'follow' }, 'Follow'), logStatus), log));
    const plots = new ChartSet(charts);
    onLeave(() => plots.destroy());
    every(POLL_MS, async () => {
      const [job, metrics] = await Promise.all([
        api('GET', `/v1/jobs/${encodeURIComponent(id)}`),
        api('GET', `/v1/jobs/${encodeURIComponent(id)}/metrics?max_points=2000`),
      ]);
      renderJobHead(head, job);
      renderSummary(summary, job);
      renderSpec(spec, job);
      plots.update(metrics);
      renderEvals(evals, reasoning, metrics.evals || []);
      renderTimeline(timeline, job);
    });
    followLog(id, log, follow, logStatus);
  }
  function renderJobHead(head, job) {
    const cancel = h('button', { type: 'button', id: 'cancel', class: 'danger',
      disabled: TERMINAL.has(job.state) || job.cancel_requested,
      onclick: async () => {
        try {
          await api('POST', `/v1/jobs/${encodeURIComponent(job.id)}/cancel`);
          say(`Cancelling ${job.id}`);
        } catch (e) { say(e.message, true); }
      } }, job.cancel_requested ? 'Cancelling…' : 'Cancel');
    head.replaceChildren(
      h('p', { class: 'job-title' }, h('strong', {}, job.name || '(unnamed)'), ' ', badge(job.state),
        ' ', h('span', { id: 'job-state', class: 'reason' }, job.reason || '')),
      h('p', {}, cancel, ' ', h('a', { href: `#/lineage/${encodeURIComponent(job.id)}` }, 'Lineage')));
  }
  function labelsText(labels) {
    return Object.entries(labels || {}).sort().map(([k, v]) => `${k}=${v}`).join(', ');
  }
  function renderSummary(dl, job) {
    const p = job.progress || {};
    const rows = [
      ['Kind', job.spec?.kind || 'pretrain'], ['Submitted by', job.submitted_by],
      ['Submitted', fmtTime(job.submit_time_ms)], ['Started', fmtTime(job.start_time_ms)],
      ['Ended', fmtTime(job.end_time_ms)], ['Step', `${p.step || 0} / ${p.total_steps || job.spec?.steps || '?'}`],
      ['Tokens/s', fmt(p.tokens_per_second)], ['World size', job.world_size],
      ['Attempt', `${job.attempt} (restarts ${job.restarts || 0}, infrastructure ${job.infra_restarts || 0}, `
        + `preempted ${job.preemptions || 0})`],
      ['Priority', String(job.priority || 0)],
      ['Started from', job.request?.init_from
        ? jobLink(checkpointJob(job.request.init_from), job.request.init_from) : 'fresh weights'],
      ['Sweep', job.sweep_id ? h('a', { href: `#/sweeps/${encodeURIComponent(job.sweep_id)}` },
        `${job.sweep_id} · ${job.sweep_cell} · seed ${job.sweep_seed}`) : '—'],
      ['Labels', labelsText(job.request?.labels) || '—'],
      ['About', job.request?.description || '—'],
    ];
    const items = rows.map(([k, v]) => [h('dt', {}, k), h('dd', {}, v)]).flat();
    dl.replaceChildren(...items);
  }
  function renderSpec(details, job) {
    const text = jsyaml.dump(job.spec || {}, { noRefs: true, lineWidth: 100 });
    const pre = details.querySelector('pre');
    if (pre.textContent !== text) pre.textContent = text;  // keeps a reader's selection otherwise
  }
  function renderEvals(evals, reasoning, list) {
    const held = list.filter((e) => e.kind !== 'reasoning');
    const rs = list.filter((e) => e.kind === 'reasoning');
    evals.replaceChildren(held.length ? table(['Step', 'Attempt', 'Split', 'Eval loss', 'Accuracy', 'Exact match'],
      held.map((e) => h('tr', {}, h('td', { class: 'num' }, e.step), h('td', { class: 'num' }, e.attempt),
        h('td', {}, e.kind || 'held-out'), h('td', { class: 'num' }, fmt(e.eval_loss)),
        h('td', { class: 'num' }, fmt(e.accuracy)), h('td', { class: 'num' }, fmt(e.exact_match)))),
      'Held-out evaluations') : h('p', { class: 'help' }, 'No evaluations yet.'));
    reasoning.replaceChildren(...(rs.length ? [table(['Step', 'Task', 'Problems', 'Samples', 'Pass@1',
      'Maj@k', 'Answered'], rs.map((e) => h('tr', {}, h('td', { class: 'num' }, e.step), h('td', {}, e.task),
      h('td', { class: 'num' }, e.problems), h('td', { class: 'num' }, e.samples),
      h('td', { class: 'num' }, fmt(e.pass_at_1)), h('td', { class: 'num' }, fmt(e.maj_at_k)),
      h('td', { class: 'num' }, fmt(e.answered)))), 'Reasoning evaluation')] : []));
  }
  function renderTimeline(ol, job) {
    const items = [];
    for (const a of job.history || []) {
      items.push({ t: num(a.start_time_ms), attempt: a.attempt, kind: 'attempt',
        text: `attempt ${a.attempt} placed on ${(a.worker_ids || []).join(', ')}` +
          (a.resumed_from ? `; resumed from ${a.resumed_from}` : '') +
          (a.end_reason ? `; ended: ${a.end_reason}` : '') });
    }
    for (const e of job.events || []) {
      const kind = e.state ? 'state' : /^checkpoint/.test(e.reason) ? 'checkpoint' : 'note';
      items.push({ t: num(e.time_ms), attempt: e.attempt, kind, state: e.state, text: e.reason });
    }
    items.sort((a, b) => a.t - b.t);
    ol.replaceChildren(...items.map((i) => h('li', { class: `event event-${i.kind}` },
      h('time', {}, fmtTime(i.t)), ' ', i.attempt ? h('span', { class: 'attempt' }, `#${i.attempt}`) : null, ' ',
      i.state ? badge(i.state) : null, ' ', i.text)));
  }
  function checkpointJob(cid) { return String(cid).split(/[./]/)[0]; }

  // The log, streamed while "Follow" is on (the API's ?follow=true), from where it stopped.
  function followLog(id, pre, box, status) {
    const MAX_CHARS = 1 << 20;
    let offset = 0, controller = null;
    const append = (text) => {
      let all = pre.textContent + text;
      if (all.length > MAX_CHARS) all = all.slice(all.indexOf('\n', all.length - MAX_CHARS) + 1);
      pre.textContent = all;
      if (box.checked) pre.scrollTop = pre.scrollHeight;
    };
    const start = async () => {
      controller = new AbortController();
      const mine = controller;
      status.textContent = 'following';
      try {
        const res = await fetch(`/v1/jobs/${encodeURIComponent(id)}/logs?follow=true&offset=${offset}`,
          { headers: { Authorization: `Bearer ${token()}` }, signal: mine.signal, cache: 'no-store' });
        if (!res.ok) throw new Error((await res.json().catch(() => ({}))).error?.message || res.statusText);
        const reader = res.body.getReader();
        const decoder = new TextDecoder();
        for (;;) {
          const { done, value } = await reader.read();
          if (done) break;
          offset += value.length;
          append(decoder.decode(value, { stream: true }));
        }
        status.textContent = 'end of log (the job has ended)';
        box.checked = false;
      } catch (e) {
        if (!mine.signal.aborted) status.textContent = `log: ${e.message}`;
      }
    };
    const stop = () => { if (controller) controller.abort(); status.textContent = 'paused'; };
    box.addEventListener('change', () => (box.checked ? start() : stop()));
    onLeave(() => controller && controller.abort());
    start();
  }

  // ---- charts ----------------------------------------------------------------------------
  // One uPlot per quantity. A line is { label, xs, ys, color } with optional dashed, spanGaps,
  // noPoints and band ('hi' followed by its 'lo' line, with the hi line's fill between them).
  class ChartSet {
    constructor(root) {
      this.root = root;
      this.plots = {};
      // Each chart follows its own panel: the grid reflows as charts are added, and a chart sized
      // while it was alone in its row would keep the row's width and overlap its neighbour.
      this.observer = new ResizeObserver((entries) => entries.forEach((e) => {
        const p = Object.values(this.plots).find((q) => q.el === e.target);
        const size = p?.plot && this.size(p.el);
        if (size && size.width !== p.plot.width) p.plot.setSize(size);
      }));
    }
    // The panel's content width (its padding left out), so the canvas stays inside it.
    size(el) {
      const style = getComputedStyle(el);
      const pad = parseFloat(style.paddingLeft) + parseFloat(style.paddingRight);
      return { width: Math.max(120, Math.floor(el.clientWidth - pad)), height: 220 };
    }
    destroy() {
      this.observer.disconnect();
      Object.values(this.plots).forEach((p) => p.plot && p.plot.destroy());
      for (const k of Object.keys(exposed.charts)) delete exposed.charts[k];
    }
    // A job's page: one series per attempt (a restart that resumes at an earlier step starts a
    // new line instead of drawing back over the old one).
    update(metrics) {
      const series = metrics.series || [];
      const evals = (metrics.evals || []).filter((e) => e.kind !== 'reasoning' && e.kind !== 'test');
      const color = (attempt) => COLORS[(attempt - 1) % COLORS.length];
      const byAttempt = (field) => series.map((s) => ({
        label: `attempt ${s.attempt}`, attempt: s.attempt, color: color(s.attempt),
        xs: s.points.map((p) => num(p.step)), ys: s.points.map((p) => finite(p[field])) }));
      const evalAttempts = [...new Set(evals.map((e) => e.attempt))].sort((a, b) => a - b);
      const evalSeries = (field, what) => evalAttempts.map((a) => {
        const es = evals.filter((e) => e.attempt === a).sort((x, y) => num(x.step) - num(y.step));
        return { label: `${what} · attempt ${a}`, attempt: a, color: color(a), dashed: true,
          xs: es.map((e) => num(e.step)), ys: es.map((e) => finite(e[field])) };
      });
      this.draw('loss', 'Loss', [...byAttempt('loss'), ...evalSeries('eval_loss', 'eval loss')]);
      this.draw('accuracy', 'Eval accuracy', evalSeries('accuracy', 'accuracy'));
      this.draw('tokens_per_second', 'Tokens/s', byAttempt('tokens_per_second'));
      this.draw('learning_rate', 'Learning rate', byAttempt('learning_rate'));
    }
    panel(name, title) {
      const el = h('figure', { class: 'chart', id: `chart-${name}`, 'aria-label': title });
      const caption = h('figcaption', {}, title);
      const summary = h('summary', {}, `${title}: data`);
      const details = h('details', {}, summary, h('div'));
      details.addEventListener('toggle', () => details.open && this.fillTable(name));
      el.append(caption, details);
      this.root.append(el);
      this.observer.observe(el);
      return (this.plots[name] = { el, caption, summary, details, plot: null, key: '' });
    }
    // how: { x: the x axis's name, logX, logY }.
    draw(name, title, lines, how = {}) {
      lines = lines.filter((l) => l.xs.length);
      const p = this.plots[name] || this.panel(name, title);
      if (p.caption.textContent !== title) {
        p.caption.textContent = title;
        p.summary.textContent = `${title}: data`;
      }
      const key = [how.x, how.logX, how.logY, ...lines.map((l) => `${l.label}/${l.color}`)].join('|');
      const data = lines.length ? uPlot.join(lines.map((l) => [l.xs, l.ys])) : [[]];
      p.lines = lines;
      p.xName = how.x || 'step';
      p.el.dataset.points = String(lines.reduce((n, l) => n + l.xs.length, 0));
      if (p.plot && p.key === key) {
        p.plot.setData(data);
      } else {
        if (p.plot) p.plot.destroy();
        p.plot = new uPlot(plotOptions(p, lines, how, this.size(p.el)), data, p.el);
        p.el.insertBefore(p.plot.root, p.details);
        p.key = key;
        // A band's edges are drawn, not named: their legend rows would double the legend.
        const rows = p.plot.root.querySelectorAll('.u-legend .u-series');
        lines.forEach((l, i) => { if (l.band && rows[i + 1]) rows[i + 1].style.display = 'none'; });
      }
      exposed.charts[name] = { lines, data: p.plot.data, x: p.xName,
        get ticks() { return p.ticks; }, get xticks() { return p.xticks; } };
      if (p.details.open) this.fillTable(name);
    }
    fillTable(name) {
      const p = this.plots[name];
      const rows = p.lines.flatMap((l) => l.xs.map((x, i) =>
        h('tr', {}, h('td', {}, l.label), h('td', { class: 'num' }, fmt(x, 10)), h('td', { class: 'num' }, fmt(l.ys[i], 6)))));
      p.details.lastChild.replaceChildren(table(['Series', p.xName, 'Value'], rows.slice(0, 5000)));
    }
  }
  function plotOptions(p, lines, how, size) {
    const x = how.x || 'step';
    return {
      ...size, legend: { live: true },
      scales: { x: { time: false, distr: how.logX ? 3 : 1 }, y: { distr: how.logY ? 3 : 1 } },
      axes: [{ label: x, values: (u, splits) => (p.xticks = tickLabels(splits)) },
        { size: 64, values: (u, splits) => (p.ticks = tickLabels(splits)) }],
      series: [{ label: x }, ...lines.map(seriesOf)],
      bands: lines.flatMap((l, i) => (l.band === 'hi' && lines[i + 1]?.band === 'lo'
        ? [{ series: [i + 1, i + 2], fill: l.fill }] : [])),
    };
  }
  function seriesOf(l) {
    return {
      label: l.label, stroke: l.color, width: l.band ? 0.5 : l.dashed ? 1.5 : 1.25,
      dash: l.dashed ? [5, 4] : undefined, spanGaps: Boolean(l.dashed || l.spanGaps),
      // Dots where they help: evaluations, and lines that are still short.
      points: { show: (u, si) => !l.band && !l.noPoints &&
        (l.dashed || u.data[si].filter((y) => y !== null).length < 40), size: 5 },
    };
  }
  // Colour i of a set of lines: the palette, then hues spread by the golden angle; `fill` is the
  // same colour, translucent, for a band.
  function colorAt(i) {
    if (i < COLORS.length) return { stroke: COLORS[i], fill: `${COLORS[i]}2e` };
    const hue = Math.round((i * 137.508) % 360);
    return { stroke: `hsl(${hue} 70% 38%)`, fill: `hsl(${hue} 70% 38% / 0.18)` };
  }

  // ---- checkpoints and lineage -----------------------------------------------------------
  async function loadLineage() {
    const [checkpoints, jobs] = await Promise.all([
      all('/v1/checkpoints', 'checkpoints'), all('/v1/jobs', 'jobs')]);
    return { checkpoints, jobs };
  }
  function viewCheckpoints() {
    const graph = h('div', { class: 'lineage', id: 'lineage' });
    const list = h('div');
    page('Checkpoints', h('section', { 'aria-labelledby': 'h-lineage' },
      h('h2', { id: 'h-lineage' }, 'Lineage'), graph),
    h('section', { 'aria-labelledby': 'h-catalogue' }, h('h2', { id: 'h-catalogue' }, 'Catalogue'), list));
    every(5000, async () => {
      const { checkpoints, jobs } = await loadLineage();
      renderLineage(graph, jobs, checkpoints, null);
      list.replaceChildren(table(['Checkpoint', 'Job', 'Kind', 'Step', 'Committed', 'Status',
        'Started from', ''], checkpoints.slice().reverse().map(checkpointRow)));
    });
  }
  function checkpointRow(c) {
    const status = c.deleted ? 'deleted' : c.damaged ? `damaged: ${c.damaged}` : c.available ? 'available' : 'missing';
    const usable = c.available && !c.damaged && !c.deleted;
    return h('tr', { 'data-checkpoint': c.id },
      h('td', {}, c.id), h('td', {}, jobLink(c.job_id, `${c.job_name || c.job_id}`)), h('td', {}, c.kind),
      h('td', { class: 'num' }, c.step), h('td', {}, fmtTime(c.time_ms)), h('td', {}, status),
      h('td', {}, c.parent ? jobLink(checkpointJob(c.parent), c.parent) : '—'),
      h('td', {}, usable ? h('a', { class: 'button', href: `#/submit?from=${encodeURIComponent(c.id)}`,
        'data-finetune': c.id }, 'Fine-tune from here') : null));
  }
  function viewLineage(rawId) {
    const id = decodeURIComponent(rawId);
    const graph = h('div', { class: 'lineage', id: 'lineage' });
    page(`Lineage of ${id}`, h('p', {}, jobLink(id, `Back to ${id}`)), graph);
    every(5000, async () => {
      const { checkpoints, jobs } = await loadLineage();
      renderLineage(graph, jobs, checkpoints, id);
    });
  }
  // Jobs as boxes in columns by generation (pretrain -> SFT -> eval ...), an edge from the
  // checkpoint a job started from to that job; `focus` keeps only its ancestors and descendants.
  function renderLineage(root, jobs, checkpoints, focus) {
    const byJob = new Map(jobs.map((j) => [j.id, j]));
    const ckByJob = new Map();
    for (const c of checkpoints) {
      if (!ckByJob.has(c.job_id)) ckByJob.set(c.job_id, []);
      ckByJob.get(c.job_id).push(c);
    }
    const parentOf = (j) => (j.request?.init_from ? checkpointJob(j.request.init_from) : null);
    const children = new Map();
    for (const j of jobs) {
      const p = parentOf(j);
      if (p) { if (!children.has(p)) children.set(p, []); children.get(p).push(j.id); }
    }
    let ids = jobs.filter((j) => parentOf(j) || children.has(j.id)).map((j) => j.id);
    if (focus) {
      const keep = new Set([focus]);
      for (let p = byJob.get(focus); p && parentOf(p); p = byJob.get(parentOf(p))) keep.add(parentOf(p));
      const down = [focus];
      while (down.length) for (const c of children.get(down.pop()) || []) { keep.add(c); down.push(c); }
      ids = ids.filter((x) => keep.has(x));
      if (!ids.length && byJob.has(focus)) ids = [focus];
    }
    if (!ids.length) {
      root.replaceChildren(h('p', { class: 'help' }, 'No job has started from a checkpoint yet.'));
      return;
    }
    const depth = new Map();
    const depthOf = (id, seen = new Set()) => {
      if (depth.has(id)) return depth.get(id);
      const j = byJob.get(id);
      const p = j && parentOf(j);
      const d = p && byJob.has(p) && !seen.has(p) ? depthOf(p, seen.add(id)) + 1 : 0;
      depth.set(id, d);
      return d;
    };
    const columns = [];
    for (const id of ids.sort()) (columns[depthOf(id)] ||= []).push(id);
    const W = 230, GAP = 70, ROW = 96, pos = new Map();
    columns.forEach((col, x) => (col || []).forEach((id, y) => pos.set(id, { x: 10 + x * (W + GAP), y: 10 + y * ROW })));
    const width = 20 + columns.length * (W + GAP) - GAP;
    const height = 20 + Math.max(...columns.map((c) => (c || []).length)) * ROW;
    const svg = s('svg', { viewBox: `0 0 ${width} ${height}`, width, height, role: 'img',
      'aria-labelledby': 'lineage-title' }, s('title', { id: 'lineage-title' }, 'Checkpoint lineage'));
    const edges = [];
    for (const id of ids) {
      const j = byJob.get(id), p = j && parentOf(j);
      if (!p || !pos.has(p)) continue;
      const a = pos.get(p), b = pos.get(id);
      const x1 = a.x + W, y1 = a.y + 36, x2 = b.x, y2 = b.y + 36;
      svg.append(s('path', { class: 'edge', d: `M${x1},${y1} C${x1 + GAP / 2},${y1} ${x2 - GAP / 2},${y2} ${x2},${y2}` }),
        s('text', { class: 'edge-label', x: x1 + 4, y: y1 - 6 }, `step ${j.request.init_from.split(/[./]/)[1] || ''}`));
      edges.push(h('li', { 'data-edge': `${p}->${id}` }, jobLink(p, `${byJob.get(p)?.name || p} (${p})`),
        ` checkpoint ${j.request.init_from} → `, jobLink(id, `${j.name} (${id})`)));
    }
    for (const id of ids) {
      const j = byJob.get(id), { x, y } = pos.get(id);
      const cks = (ckByJob.get(id) || []).map((c) => c.step);
      const shown = cks.length > 4 ? [...cks.slice(0, 2), '…', ...cks.slice(-2)] : cks;
      svg.append(s('a', { href: `#/jobs/${encodeURIComponent(id)}`, class: `node kind-${j?.spec?.kind || 'pretrain'}`,
        'data-node': id, 'aria-label': `${j?.name} ${id}` },
        s('rect', { x, y, width: W, height: 72, rx: 6 }),
        s('text', { x: x + 10, y: y + 20, class: 'node-name' }, `${j?.name || id} · ${j?.spec?.kind || 'pretrain'}`),
        s('text', { x: x + 10, y: y + 38 }, `${id} · ${j?.state || ''}`),
        s('text', { x: x + 10, y: y + 56, class: 'node-ckpt' }, cks.length ? `checkpoints: ${shown.join(', ')}` : 'no checkpoints')));
    }
    root.replaceChildren(h('div', { class: 'graph-wrap' }, svg), h('ul', { class: 'edges', 'aria-label': 'Lineage edges' }, edges));
  }

  // ---- submit ----------------------------------------------------------------------------
  function viewSubmit(query) {
    const q = params(query);
    const editor = h('textarea', { id: 'spec-editor', spellcheck: 'false', rows: 24, 'aria-describedby': 'spec-help spec-errors',
      autocapitalize: 'off', autocomplete: 'off', wrap: 'off' });
    const gutter = h('div', { class: 'gutter', 'aria-hidden': 'true' });
    const notes = h('div', { class: 'notes' });
    const errors = h('ul', { id: 'spec-errors', class: 'errors', 'aria-live': 'assertive' });
    let requestId = `console-${crypto.getRandomValues(new Uint32Array(2)).join('-')}`;
    const lineHeight = () => parseFloat(getComputedStyle(editor).lineHeight) || 18;
    const layout = () => {
      const n = editor.value.split('\n').length;
      gutter.replaceChildren(...Array.from({ length: n }, (_, i) => h('div', { 'data-line': i + 1 }, i + 1)));
      gutter.scrollTop = editor.scrollTop;
      notes.style.transform = `translateY(${-editor.scrollTop}px)`;
    };
    editor.addEventListener('input', layout);
    editor.addEventListener('scroll', layout);
    const showErrors = (list) => {
      notes.replaceChildren();
      errors.replaceChildren();
      editor.removeAttribute('aria-invalid');
      for (const g of gutter.children) g.classList.remove('bad');
      for (const { field, message, line } of list) {
        errors.append(h('li', { class: 'field-error', 'data-field': field || '' },
          line === null ? null : h('button', { type: 'button', class: 'quiet', onclick: () => goToLine(editor, line) }, `line ${line + 1}`),
          ' ', message));
        if (line !== null) {
          editor.setAttribute('aria-invalid', 'true');
          gutter.children[line]?.classList.add('bad');
          const note = h('div', { class: 'note field-error', 'data-field': field || '', role: 'note' }, message);
          note.style.top = `${line * lineHeight() + 6}px`;
          notes.append(note);
        }
      }
    };
    const submit = h('button', { type: 'submit', id: 'submit' }, 'Submit');
    const form = h('form', { class: 'submit', onsubmit: async (ev) => {
      ev.preventDefault();
      let request;
      try { request = parseRequest(editor.value); } catch (e) {
        return showErrors([{ field: '', message: e.message, line: e.line ?? null }]);
      }
      if (!request.request_id) request.request_id = requestId;
      submit.disabled = true;
      try {
        const r = await api('POST', '/v1/jobs', request);
        requestId = `console-${crypto.getRandomValues(new Uint32Array(2)).join('-')}`;
        showErrors([]);
        say(r.created ? `Submitted ${r.id}` : `${r.id} already existed (same request id)`);
        location.hash = `#/jobs/${encodeURIComponent(r.id)}`;
      } catch (e) {
        const fields = e.fields.length ? e.fields : [{ field: (e.message.match(/^([\w.[\]]+): /) || [])[1] || '', description: e.message }];
        showErrors(fields.map((f) => ({ field: f.field, message: e.fields.length ? `${f.field}: ${f.description}` : f.description,
          line: f.field ? lineOfField(editor.value, request.__bare ? f.field.replace(/^spec\./, '') : f.field) : null })));
      } finally { submit.disabled = false; }
    } },
    h('label', { for: 'spec-editor' }, 'Job request (YAML or JSON)'),
    h('p', { id: 'spec-help', class: 'help' }, 'What ', h('code', {}, 'loom submit'), ' takes: a ',
      h('code', {}, 'spec:'), ' section and world_size, max_restarts, init_from, priority, pool. The coordinator ',
      'validates it; its errors appear next to the line they name.'),
    h('div', { class: 'editor' }, gutter, editor, notes), errors, submit);
    page('Submit a job', form);
    const from = q.get('from');
    editor.value = q.get('spec') || 'spec:\n  name: my-job\n  preset: tiny-cpu\n  steps: 100\nworld_size: 1\n';
    layout();
    if (from) {
      prefillFineTune(from).then((text) => { editor.value = text; layout(); })
        .catch((e) => say(e.message, true));
    }
  }
  // A fine-tune of `checkpointId`: the request its job was submitted with, renamed, starting
  // from that checkpoint. The user edits what differs (kind, data, steps).
  async function prefillFineTune(checkpointId) {
    const job = await api('GET', `/v1/jobs/${encodeURIComponent(checkpointJob(checkpointId))}`);
    const request = prune(JSON.parse(JSON.stringify(job.request || {}))) || {};
    delete request.request_id;
    request.init_from = checkpointId;
    request.spec = request.spec || {};
    request.spec.name = `${request.spec.name || job.name || 'job'}-ft`;
    return `# Fine-tune from ${checkpointId} (${job.name}); edit kind, data and steps as needed.\n` +
      jsyaml.dump(request, { noRefs: true, lineWidth: 100 });
  }
  // The API prints every field; the form shows what was set (zero values are proto3 defaults).
  function prune(v) {
    if (Array.isArray(v)) {
      const a = v.map(prune).filter((x) => x !== undefined);
      return a.length ? a : undefined;
    }
    if (v && typeof v === 'object') {
      const o = {};
      for (const [k, x] of Object.entries(v)) { const p = prune(x); if (p !== undefined) o[k] = p; }
      return Object.keys(o).length ? o : undefined;
    }
    return v === '' || v === 0 || v === '0' || v === false || v === null ? undefined : v;
  }
  function parseRequest(text) {
    let obj;
    if (/^\s*[{[]/.test(text)) {
      try { obj = JSON.parse(text); } catch (e) {
        const at = /position (\d+)/.exec(e.message);
        const err = new Error(`JSON: ${e.message}`);
        err.line = at ? text.slice(0, Number(at[1])).split('\n').length - 1 : null;
        throw err;
      }
    } else {
      try { obj = jsyaml.load(text, { schema: jsyaml.JSON_SCHEMA }); } catch (e) {
        const err = new Error(`YAML: ${e.reason || e.message}`);
        err.line = e.mark ? e.mark.line : null;
        throw err;
      }
    }
    if (!obj || typeof obj !== 'object' || Array.isArray(obj)) throw new Error('expected a mapping (spec:, world_size:, ...)');
    if (!('spec' in obj)) { obj = { spec: obj }; Object.defineProperty(obj, '__bare', { value: true }); }
    return obj;
  }
  // The 0-based line that a field path (spec.model.schedule[1].attention) names in YAML or JSON
  // text: each key is looked for after the previous one; the deepest found wins.
  function lineOfField(text, field) {
    const lines = text.split('\n');
    const parts = [];
    for (const p of field.split('.')) {
      const m = /^([^[]*)((?:\[\d+\])*)$/.exec(p);
      if (!m) { parts.push(p); continue; }
      if (m[1]) parts.push(m[1]);
      for (const i of m[2].match(/\d+/g) || []) parts.push(Number(i));
    }
    let line = 0, found = 0, indent = -1;
    const esc = (x) => x.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
    for (const part of parts) {
      if (typeof part === 'number') {
        let count = -1, hit = -1;
        for (let i = line + 1; i < lines.length; i++) {
          const ind = lines[i].search(/\S/);
          if (ind < 0) continue;
          if (ind <= indent && !/^\s*-/.test(lines[i])) break;
          if (/^\s*-(\s|$)/.test(lines[i]) && ind >= indent) { if (++count === part) { hit = i; break; } }
        }
        if (hit < 0) break;
        line = found = hit;
        indent = lines[hit].search(/\S/);
        continue;
      }
      const re = new RegExp(`(^|[\\s{,-])"?${esc(part)}"?\\s*:`);
      let hit = -1;
      for (let i = line; i < lines.length; i++) if (re.test(lines[i])) { hit = i; break; }
      if (hit < 0) break;
      line = found = hit;
      indent = lines[hit].search(/\S/);
    }
    return found;
  }
  function goToLine(editor, line) {
    const lines = editor.value.split('\n');
    const start = lines.slice(0, line).reduce((n, l) => n + l.length + 1, 0);
    editor.focus();
    editor.setSelectionRange(start, start + (lines[line] || '').length);
  }

  // ---- workers ---------------------------------------------------------------------------
  function viewWorkers() {
    const body = h('div');
    page('Workers', body);
    every(POLL_MS, async () => {
      const [workers, running, quotas] = await Promise.all([all('/v1/workers', 'workers'),
        Promise.all(['scheduled', 'running'].map((st) => all(`/v1/jobs?state=${st}`, 'jobs'))).then((x) => x.flat()),
        api('GET', '/v1/quotas').then((r) => (r && r.quotas) || [])]);
      const onWorker = new Map();
      for (const j of running) for (const p of j.placement || []) {
        if (!onWorker.has(p.worker_id)) onWorker.set(p.worker_id, []);
        onWorker.get(p.worker_id).push(h('div', {}, jobLink(j.id), ` attempt ${j.attempt}, ranks ${(p.ranks || []).join(',')}`));
      }
      body.replaceChildren(table(['Worker', 'Address', 'State', 'Slots', 'GPUs', 'Labels', 'Last heartbeat', 'Running'],
        workers.map((w) => h('tr', { 'data-worker': w.id },
          h('td', {}, h('strong', {}, w.name), h('br'), h('span', { class: 'help' }, w.id)), h('td', {}, w.address),
          h('td', {}, badge(w.state)),
          h('td', {}, h('meter', { min: 0, max: w.slots || 1, value: w.used_slots || 0, 'aria-label': `${w.name} slots used` }),
            ` ${w.used_slots || 0}/${w.slots}`),
          h('td', {}, (w.gpus || []).map((g) => h('div', {}, `${g.index}: ${g.model || 'GPU'}`))),
          h('td', {}, Object.entries(w.labels || {}).map(([k, v]) => h('span', { class: 'chip' }, `${k}=${v}`))),
          h('td', {}, fmtAge(w.last_heartbeat_ms)), h('td', {}, onWorker.get(w.id) || '—')))),
        h('h2', {}, 'Quotas and fair-share weights'),
        quotas.length ? table(['Kind', 'Name', 'Slots used', 'Weight'], quotas.map((q) => h('tr', { 'data-quota': `${q.kind}/${q.name}` },
          h('td', {}, q.kind), h('td', {}, q.name),
          h('td', {}, q.slots === undefined ? `${q.used || 0} (no limit)` : `${q.used || 0} of ${q.slots}`),
          h('td', {}, q.kind === 'user' ? String(q.weight || 1) : '—'))))
          : h('p', { class: 'help' }, 'No quotas: every user may use every slot; fair-share weights are all 1.'));
    });
  }

  // ---- sweeps ----------------------------------------------------------------------------
  function viewSweeps() {
    const body = h('div');
    page('Sweeps', body);
    every(5000, async () => {
      const sweeps = await all('/v1/sweeps', 'sweeps');
      body.replaceChildren(sweeps.length ? table(['Sweep', 'Name', 'State', 'Jobs', 'Submitted'],
        sweeps.slice().reverse().map((w) => h('tr', {},
          h('td', {}, h('a', { href: `#/sweeps/${encodeURIComponent(w.id)}` }, w.id)), h('td', {}, w.name),
          h('td', {}, badge(w.state)),
          h('td', {}, Object.entries(w.job_states || {}).map(([k, v]) => `${k} ${v}`).join(', ')),
          h('td', {}, fmtTime(w.submit_time_ms))))) : h('p', { class: 'help' }, 'No sweeps.'));
    });
  }
  function viewSweep(rawId) {
    const id = decodeURIComponent(rawId);
    const body = h('div');
    const compare = h('a', { id: 'sweep-compare', href: '#/compare' }, 'Compare its jobs');
    page(`Sweep ${id}`, h('p', {}, h('a', { href: `#/jobs?sweep=${encodeURIComponent(id)}` }, 'Its jobs'), ' · ', compare),
      body, sweepCurves(id));
    every(5000, async () => {
      const [r, sweep] = await Promise.all([api('GET', `/v1/sweeps/${encodeURIComponent(id)}/report`),
        api('GET', `/v1/sweeps/${encodeURIComponent(id)}`)]);
      compare.href = compareHash((sweep.jobs || []).map((j) => j.job_id), compareSettings(params('')));
      const ci = (lo, hi) => `[${fmt(lo)}, ${fmt(hi)}]`;
      const count = (v) => h('td', { class: 'num' }, v || 0);
      // select reach: values are steps until the threshold; censored seeds and who got there first.
      const reach = r.select === 'reach';
      const what = reach
        ? `Steps until ${r.metric} ${r.metric === 'eval_loss' ? '≤' : '≥'} ${r.threshold} (reach; censored seeds are not in the mean)`
        : `Metric ${r.metric} (${r.select})`;
      body.replaceChildren(
        h('p', {}, `${what}; baseline ${r.baseline}; `, r.complete ? 'complete' : 'jobs still running'),
        table(['Cell', 'n', ...(reach ? ['Censored'] : []), 'Pending', 'Failed', 'Mean', '95% interval'],
          (r.cells || []).map((c) => h('tr', {},
            h('td', {}, c.cell), count(c.n), ...(reach ? [count(c.censored)] : []), count(c.pending), count(c.failed),
            h('td', { class: 'num' }, fmt(c.mean)), h('td', { class: 'num' }, ci(c.ci_low, c.ci_high)))), 'Cells'),
        table(['Cell', 'Baseline', ...(reach ? ['First', 'Later', 'Ties', 'Unordered', 'Sign test p'] : []),
          'Paired n', 'Mean difference', '95% paired t', '95% bootstrap', 'p'],
          (r.differences || []).map((d) => h('tr', {}, h('td', {}, d.cell), h('td', {}, d.baseline),
            ...(reach ? [count(d.first), count(d.later), count(d.ties), count(d.unordered),
              h('td', { class: 'num' }, fmt(d.sign_p_value))] : []),
            count(d.n), h('td', { class: 'num' }, fmt(d.mean)),
            h('td', { class: 'num' }, ci(d.t_low, d.t_high)), h('td', { class: 'num' }, ci(d.boot_low, d.boot_high)),
            h('td', { class: 'num' }, fmt(d.p_value)))), 'Paired differences against the baseline'));
    });
  }

  // A sweep's curves (GET /v1/sweeps/{id}/curves): each cell's mean with its 95% band across
  // seeds, and each cell's paired difference from the baseline with its 95% paired-t band.
  const CURVE_METRICS = ['eval_loss', 'accuracy', 'exact_match'];
  function sweepCurves(id) {
    const select = h('select', { id: 'curves-metric' }, CURVE_METRICS.map((m) => h('option', { value: m }, m)));
    const note = h('p', { class: 'help', id: 'curves-note' });
    const charts = h('div', { class: 'charts', id: 'sweep-charts' });
    const plots = new ChartSet(charts);
    onLeave(() => plots.destroy());
    let metric = '';  // '': the sweep's own
    const refresh = async () => {
      const c = await api('GET', `/v1/sweeps/${encodeURIComponent(id)}/curves` +
        (metric ? `?metric=${encodeURIComponent(metric)}` : ''));
      if (!metric) select.value = c.metric;
      note.textContent = `${c.metric} at each evaluation step; baseline ${c.baseline}; ` +
        `${c.complete ? 'complete' : 'jobs still running'}. Bands are pointwise 95% intervals.` +
        (c.warnings?.length ? ` ${c.warnings.join(' ')}` : '');
      drawSweepCurves(plots, c);
    };
    select.addEventListener('change', () => { metric = select.value; refresh().catch((e) => say(e.message, true)); });
    every(5000, refresh);
    return h('section', { 'aria-labelledby': 'h-sweep-curves' }, h('h2', { id: 'h-sweep-curves' }, 'Curves'),
      h('form', { class: 'filters', onsubmit: (e) => e.preventDefault() },
        h('div', { class: 'field' }, h('label', { for: 'curves-metric' }, 'Metric'), select)), note, charts);
  }
  function bandLines(label, points, color) {
    const xs = points.map((p) => num(p.step));
    const of = (k) => points.map((p) => num(p[k] || 0));  // zero fields are left out of the JSON
    return [{ label, xs, ys: of('mean'), color: color.stroke, spanGaps: true },
      { label: `${label} · 95% high`, xs, ys: of('ci_high'), color: color.fill, band: 'hi', fill: color.fill, spanGaps: true },
      { label: `${label} · 95% low`, xs, ys: of('ci_low'), color: color.fill, band: 'lo', spanGaps: true }];
  }
  function drawSweepCurves(plots, c) {
    const cells = c.cells || [];
    const colorOf = (cell) => colorAt(Math.max(0, cells.findIndex((x) => x.cell === cell)));
    plots.draw('sweep_curves', `${c.metric} by cell: mean and 95% band across seeds`,
      cells.flatMap((x) => bandLines(x.cell, x.points || [], colorOf(x.cell))));
    const diffs = (c.differences || []).flatMap((d) => bandLines(`${d.cell} − ${d.baseline}`, d.points || [], colorOf(d.cell)));
    const steps = [...new Set(diffs.flatMap((l) => l.xs))].sort((a, b) => a - b);
    const zero = { label: 'zero', xs: steps, ys: steps.map(() => 0), color: '#6b7280', noPoints: true };
    plots.draw('sweep_differences', `${c.metric}: cell − ${c.baseline}, paired by seed, 95% paired-t band`,
      diffs.length ? [...diffs, zero] : []);
  }

  // ---- compare -------------------------------------------------------------------------
  // #/compare?jobs=ID,ID&x=step|tokens|flops&smooth=0.6&logx=1&logy=1: jobs overlaid, one chart
  // per quantity. Each job is one line: its attempts joined (a resumed attempt replaces what the
  // previous one logged from its first step on), evaluations the latest attempt's at each step.
  const MAX_COMPARE = 20;
  const ALIGN = {
    step: ['step', (p) => num(p.step)],
    tokens: ['tokens', (p) => num(p.tokens_seen || 0)],
    flops: ['training FLOPs', (p) => num(p.train_flops || 0)],
  };
  const COMPARED = [ // chart name, title, field, from the evaluations?
    ['loss', 'Training loss', 'loss', false], ['eval_loss', 'Eval loss', 'eval_loss', true],
    ['accuracy', 'Eval accuracy', 'accuracy', true], ['tokens_per_second', 'Tokens/s', 'tokens_per_second', false],
    ['learning_rate', 'Learning rate', 'learning_rate', false]];
  function compareSettings(q) {
    const smooth = Number(q.get('smooth') || 0);
    return { x: ALIGN[q.get('x')] ? q.get('x') : 'step', logX: q.get('logx') === '1', logY: q.get('logy') === '1',
      smooth: Number.isFinite(smooth) ? Math.min(0.99, Math.max(0, smooth)) : 0 };
  }
  function compareHash(ids, how) {
    const q = new URLSearchParams({ jobs: ids.join(',') });
    if (how.x !== 'step') q.set('x', how.x);
    if (how.smooth) q.set('smooth', String(how.smooth));
    if (how.logX) q.set('logx', '1');
    if (how.logY) q.set('logy', '1');
    return `#/compare?${q.toString().replace(/%2C/g, ',')}`;
  }
  function viewCompare(query) {
    const q = params(query);
    const ids = [...new Set((q.get('jobs') || '').split(',').map((x) => x.trim()).filter(Boolean))];
    const how = compareSettings(q);
    const problems = h('ul', { class: 'errors', id: 'compare-problems', 'aria-live': 'polite' });
    const legend = h('ul', { class: 'legend', id: 'compare-legend', 'aria-label': 'Jobs compared' });
    const charts = h('div', { class: 'charts', id: 'compare-charts' });
    const plots = new ChartSet(charts);
    let loaded = [];
    const redraw = () => {
      history.replaceState(null, '', compareHash(ids, how));  // shareable; no hashchange
      drawCompare(plots, loaded, how);
    };
    page('Compare jobs', compareControls(how, redraw), problems, legend, charts);
    onLeave(() => plots.destroy());
    const refused = !ids.length
      ? 'No jobs to compare: tick them on the Jobs page and press Compare, or list them in the URL (#/compare?jobs=ID,ID).'
      : ids.length > MAX_COMPARE
        ? `${ids.length} jobs named: at most ${MAX_COMPARE} can be compared at once. Remove some from the URL.` : '';
    if (refused) return problems.append(h('li', { 'data-problem': 'refused' }, refused));
    every(5000, async () => {
      loaded = await loadCompared(ids, loaded);
      renderCompareProblems(problems, loaded, how);
      renderLegend(legend, loaded);
      drawCompare(plots, loaded, how);
    });
  }
  function compareControls(how, changed) {
    const set = (k, v) => { how[k] = v; changed(); };
    const check = (id, label, k) => h('div', { class: 'field check' },
      h('input', { id, type: 'checkbox', checked: how[k], onchange: (e) => set(k, e.target.checked) }),
      h('label', { for: id }, label));
    return h('form', { class: 'filters', id: 'compare-controls', onsubmit: (e) => e.preventDefault() },
      h('div', { class: 'field' }, h('label', { for: 'compare-x' }, 'Align by'),
        h('select', { id: 'compare-x', onchange: (e) => set('x', e.target.value) },
          Object.entries(ALIGN).map(([k, [label]]) => h('option', { value: k, selected: k === how.x }, label)))),
      h('div', { class: 'field' }, h('label', { for: 'compare-smooth' }, 'Smoothing (EMA weight, 0 = raw)'),
        h('input', { id: 'compare-smooth', type: 'number', min: 0, max: 0.99, step: 0.05, value: how.smooth,
          onchange: (e) => set('smooth', compareSettings(params(`smooth=${e.target.value}`)).smooth) })),
      check('compare-logx', 'Log x', 'logX'), check('compare-logy', 'Log y', 'logY'));
  }
  // Each job's record and metrics, or why there are none. Ended jobs and unknown ids are not
  // asked for again.
  function loadCompared(ids, before) {
    return Promise.all(ids.map(async (id, i) => {
      const old = before[i];
      if (old && (old.gone || TERMINAL.has(old.job?.state))) return old;
      const path = `/v1/jobs/${encodeURIComponent(id)}`;
      try {
        const [job, metrics] = await Promise.all([api('GET', path), api('GET', `${path}/metrics?max_points=2000`)]);
        return { id, color: colorAt(i).stroke, job, metrics };
      } catch (e) {
        if (e instanceof ApiError && e.status === 401) throw e;
        const gone = e instanceof ApiError && (e.status === 404 || e.status === 400);
        return { id, color: colorAt(i).stroke, gone, error: gone ? 'no such job' : e.message };
      }
    }));
  }
  function renderCompareProblems(ul, loaded, how) {
    const items = loaded.filter((j) => j.error).map((j) => [j.id, `${j.id}: ${j.error}; not drawn.`]);
    if (how.x !== 'step') {
      for (const j of loaded.filter((x) => x.job && !alignable(x, how.x))) {
        const what = ALIGN[how.x][0];
        items.push([j.id, `${j.id}: no ${what} recorded (trained before Loom kept them, or no steps yet); not drawn by ${what}.`]);
      }
    }
    ul.replaceChildren(...items.map(([id, text]) => h('li', { 'data-problem': id }, text)));
  }
  function renderLegend(ul, loaded) {
    ul.replaceChildren(...loaded.filter((j) => j.job).map((j) => {
      const swatch = h('span', { class: 'swatch', 'aria-hidden': 'true' });
      swatch.style.background = j.color;  // CSSOM: the CSP allows no style attributes
      return h('li', { 'data-job': j.id }, swatch, jobLink(j.id), ' ', h('strong', {}, j.job.name || '(unnamed)'),
        ' · ', attentionOf(j.job.spec), j.job.sweep_id ? ` · ${j.job.sweep_cell}, seed ${j.job.sweep_seed}` : '',
        ' · ', badge(j.job.state));
    }));
  }
  // The attention layers of a resolved spec, counted: "4× iha (window 32, P 2)" or
  // "2× local (window 32) + 2× mha". The schedule's entries are cycled to n_layers.
  function attentionOf(spec) {
    const m = spec?.model || {};
    const schedule = m.schedule?.length ? m.schedule : [{ repeat: 1, attention: { plugin: 'mha' } }];
    const layers = Math.min(num(m.n_layers) || 0, 4096), counts = new Map();
    for (let layer = 0, i = 0; layer < layers; i++) {
      const e = schedule[i % schedule.length], a = e.attention || {};
      const about = [num(a.window) ? `window ${num(a.window)}` : '', a.options?.p ? `P ${a.options.p}` : ''].filter(Boolean);
      const kind = `${a.plugin || 'mha'}${about.length ? ` (${about.join(', ')})` : ''}`;
      const n = Math.min(Math.max(1, num(e.repeat) || 1), layers - layer);
      counts.set(kind, (counts.get(kind) || 0) + n);
      layer += n;
    }
    return [...counts].map(([kind, n]) => `${n}× ${kind}`).join(' + ') || 'attention unknown';
  }
  function alignable(j, x) {
    const pts = jobPoints(j.metrics);
    return x === 'step' || (pts.length > 0 && ALIGN[x][1](pts[pts.length - 1]) > 0);
  }
  function jobPoints(metrics) {
    let out = [];
    for (const s of (metrics.series || []).slice().sort((a, b) => a.attempt - b.attempt)) {
      const pts = s.points || [];
      if (pts.length) out = [...out.filter((p) => num(p.step) < num(pts[0].step)), ...pts];
    }
    return out;
  }
  function jobEvals(metrics) {
    const latest = new Map();
    for (const e of metrics.evals || []) {
      if (!['', 'heldout', 'validation'].includes(e.kind || '')) continue;
      const at = latest.get(num(e.step));
      if (!at || e.attempt >= at.attempt) latest.set(num(e.step), e);
    }
    return [...latest.values()].sort((a, b) => num(a.step) - num(b.step));
  }
  // The x of an evaluation at `step`: the training point's at that step, else interpolated
  // between its neighbours (a thinned series); 0 at step 0.
  function xAtStep(points, xOf, step) {
    if (step <= 0) return 0;
    const i = points.findIndex((p) => num(p.step) >= step);
    const b = points[i >= 0 ? i : points.length - 1], a = i > 0 ? points[i - 1] : { step: 0 };
    if (!b) return null;
    const sa = num(a.step), sb = num(b.step), xa = i > 0 ? xOf(a) : 0, xb = xOf(b);
    return sb === sa ? xb : xa + ((xb - xa) * (step - sa)) / (sb - sa);
  }
  function smooth(ys, w) {
    let s = null;
    return ys.map((y) => (y === null ? null : (s = s === null || !w ? y : w * s + (1 - w) * y)));
  }
  function compareLine(j, field, fromEvals, how) {
    const points = jobPoints(j.metrics), xOf = ALIGN[how.x][1];
    const items = fromEvals ? jobEvals(j.metrics) : points;
    let xs = items.map((e) => (fromEvals ? xAtStep(points, xOf, num(e.step)) : xOf(e)));
    let ys = smooth(items.map((e) => finite(e[field] ?? 0)), how.smooth);
    const keep = xs.map((x, i) => x !== null && (!how.logX || x > 0) && (!how.logY || ys[i] > 0));
    [xs, ys] = [xs.filter((_, i) => keep[i]), ys.filter((_, i) => keep[i])];
    return { label: j.id, job: j.id, color: j.color, xs, ys, spanGaps: true, dashed: fromEvals };
  }
  function drawCompare(plots, loaded, how) {
    const drawn = loaded.filter((j) => j.job && alignable(j, how.x));
    for (const [name, title, field, fromEvals] of COMPARED) {
      plots.draw(`compare_${name}`, title, drawn.map((j) => compareLine(j, field, fromEvals, how)),
        { x: ALIGN[how.x][0], logX: how.logX, logY: how.logY });
    }
  }

  // ---- routing ---------------------------------------------------------------------------
  const routes = [
    [/^#\/login$/, viewLogin, ''],
    [/^#\/jobs\/([^/?]+)$/, viewJob, 'jobs'],
    [/^#\/jobs(?:\?(.*))?$/, viewJobs, 'jobs'],
    [/^#\/checkpoints$/, viewCheckpoints, 'checkpoints'],
    [/^#\/lineage\/([^/?]+)$/, viewLineage, 'checkpoints'],
    [/^#\/submit(?:\?(.*))?$/, viewSubmit, 'submit'],
    [/^#\/workers$/, viewWorkers, 'workers'],
    [/^#\/sweeps$/, viewSweeps, 'sweeps'],
    [/^#\/sweeps\/([^/?]+)$/, viewSweep, 'sweeps'],
    [/^#\/compare(?:\?(.*))?$/, viewCompare, 'jobs'],
  ];
  function route() {
    // `loom up` prints /#token=...: keep it for this tab, then drop it from the address bar.
    const t = /^#token=([^&]+)/.exec(location.hash);
    if (t) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(t[1]));
      history.replaceState(null, '', `${location.pathname}#/jobs`);
    }
    cleanups.forEach((f) => f());
    cleanups = [];
    say('');
    const hash = location.hash || '#/jobs';
    if (!token() && hash !== '#/login') { location.hash = '#/login'; return; }
    document.getElementById('logout').hidden = !token();
    const [re, view, section] = routes.find(([r]) => r.test(hash)) || [null, viewJobs, 'jobs'];
    for (const a of document.querySelectorAll('nav a')) {
      if (a.dataset.section === section) a.setAttribute('aria-current', 'page');
      else a.removeAttribute('aria-current');
    }
    view(...(re ? re.exec(hash).slice(1) : []));
    document.getElementById('page-title')?.focus({ preventScroll: true });
  }
  document.getElementById('logout').addEventListener('click', () => {
    sessionStorage.removeItem(TOKEN_KEY);
    location.hash = '#/login';
  });
  window.addEventListener('hashchange', route);
  route();
})();
