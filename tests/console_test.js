// The web console in a real browser: Debian's headless Chromium driven by puppeteer-core against
// a live `loom up` (coordinator + one worker, real training on the CPU). It logs in, finds the
// demo job, checks that the loss chart holds exactly the points the trainer logged (read from
// the page's chart data, compared with the trainer's JSONL) and that what a person sees holds
// together (charts inside their panels at 1280 and 390 px, axis labels distinct, nothing added by
// the refreshes), follows the log to its end, gets a
// field error for an invalid spec next to its line, submits and cancels a job, fine-tunes from a
// checkpoint and opens the lineage of the fine-tune; runs a small sweep and checks its curves
// against the API, then compares jobs (picked on the jobs list, and by URL) against their metrics
// by step, tokens and training FLOPs. Screenshots of each page go to --out.
//
// node tests/console_test.js --loom build/bin/loom --source-dir . --out build/console-screenshots
'use strict';
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const { setup } = require('./js_testlib.js');
const { args, source } = setup(module);
const puppeteer = require('puppeteer-core');
const yaml = require('js-yaml');
const out = path.resolve(args.out || 'console-screenshots');
const chromium = args.chromium || '/usr/bin/chromium';
fs.mkdirSync(out, { recursive: true });

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'loom-console-'));
let up = null, browser = null, page = null;
const problems = [], requests = [];

async function cleanup() {
  if (browser) await browser.close().catch(() => {});
  if (up && up.exitCode === null) {
    up.kill('SIGINT');
    await Promise.race([new Promise((r) => up.once('exit', r)), sleep(15000)]);
    if (up.exitCode === null) up.kill('SIGKILL');
  }
  fs.rmSync(tmp, { recursive: true, force: true });
}
const deadline = setTimeout(async () => {
  console.error('FAIL: console_test did not finish within 720 s');
  await cleanup();
  process.exit(1);
}, 720000);

// `loom up` on a free port; resolves with the console URL it prints.
function startLoomUp() {
  up = spawn(args.loom, ['up', '--workers', '1', '--slots', '2', '--labels', 'pool=cpu', '--port', '0', '--data-dir',
    path.join(tmp, 'up')], {
    env: { ...process.env, OMP_NUM_THREADS: '1', XDG_CONFIG_HOME: path.join(tmp, 'xdg') },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const logFile = fs.createWriteStream(path.join(out, 'loom-up.log'));
  up.stderr.pipe(logFile);
  return new Promise((resolve, reject) => {
    let text = '';
    up.stdout.on('data', (d) => {
      logFile.write(d);
      text += d;
      const m = /console: (http:\/\/127\.0\.0\.1:(\d+))\/#token=(\S+)/.exec(text);
      if (m) resolve({ base: m[1], token: m[3], url: `${m[1]}/#token=${m[3]}` });
    });
    up.once('exit', (code) => reject(new Error(`loom up exited with ${code}`)));
    setTimeout(() => reject(new Error('loom up printed no console URL in 30 s')), 30000);
  });
}

async function rest(base, token, method, p, body) {
  const res = await fetch(base + p, {
    method, body: body && JSON.stringify(body),
    headers: { ...(token ? { Authorization: `Bearer ${token}` } : {}),
      ...(body ? { 'Content-Type': 'application/json' } : {}) },
  });
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch (e) { json = null; }
  return { status: res.status, json, text, type: res.headers.get('content-type'),
    csp: res.headers.get('content-security-policy') };
}

async function waitFor(what, fn, timeoutMs = 120000) {
  const end = Date.now() + timeoutMs;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(250);
  }
}

// Clicks `selector` on a page that redraws as a job's state arrives: when the element found is
// replaced before the click lands (puppeteer: "Node is detached from document"), finds it again.
async function clickLive(page, selector, tries = 5) {
  for (let i = 1; ; i++) {
    try {
      return await page.click(selector);
    } catch (e) {
      if (i >= tries || !/detached/.test(e.message)) throw e;
      await sleep(200);
    }
  }
}
// A screenshot, after checking that no value was rendered as a JavaScript placeholder.
async function shot(page, name, fullPage = false) {
  const text = await page.$eval('main', (el) => el.innerText);
  assert.doesNotMatch(text, /\b(null|undefined)\b|\[object Object\]/, `${name}: a placeholder on the page`);
  await page.screenshot({ path: path.join(out, `${name}.png`), fullPage });
}
const textOf = (page, sel) => page.$eval(sel, (el) => el.textContent);

// What a person sees of a page's charts: `count` of them (a job page's four), each canvas inside
// its panel.
async function checkChartsFit(page, where, count = 4) {
  await page.waitForFunction((n) => document.querySelectorAll('figure.chart canvas').length >= n, {}, count);
  await sleep(300);  // a layout and its resize observations
  const boxes = await page.$$eval('figure.chart', (figs) => figs.map((f) => {
    const r = f.getBoundingClientRect(), c = f.querySelector('canvas')?.getBoundingClientRect();
    return { id: f.id, panel: [r.left, r.right], canvas: c ? [c.left, c.right] : null };
  }));
  assert.equal(boxes.length, count, `${where}: ${boxes.map((b) => b.id)}`);
  for (const b of boxes) {
    assert.ok(b.canvas && b.canvas[0] >= b.panel[0] - 0.5 && b.canvas[1] <= b.panel[1] + 0.5,
      `${where}: ${b.id}'s canvas ${b.canvas} is not inside its panel ${b.panel}`);
  }
}

// Every element of the page by tag, id and class, counted: a refresh must not add any.
const elementCounts = (page) => page.$$eval('main *', (els) => {
  const n = {};
  for (const e of els) {
    const key = `${e.tagName}${e.id ? `#${e.id}` : ''}.${[...e.classList].sort().join('.')}`;
    n[key] = (n[key] || 0) + 1;
  }
  return n;
});
// Every chart's axis labels, x and y, can be told apart.
async function checkTicks(page, where) {
  const ticks = await page.evaluate(() => Object.entries(window.loomConsole.charts)
    .map(([name, c]) => [name, (c.ticks || []).filter(Boolean), (c.xticks || []).filter(Boolean)]));
  for (const [name, ...axes] of ticks) {
    for (const shown of axes) assert.equal(new Set(shown).size, shown.length, `${where}: ${name}: axis labels ${shown}`);
  }
}
// A job's steps as the compare view draws them: its attempts joined, each resumed attempt
// replacing what the earlier ones logged from its first step on.
function joinedSteps(metrics) {
  let out = [];
  for (const s of [...metrics.series].sort((a, b) => a.attempt - b.attempt)) {
    out = [...out.filter((p) => Number(p.step) < Number(s.points[0].step)), ...s.points];
  }
  return out;
}
// Held-out evaluations, the latest attempt's at each step.
function heldOutEvals(metrics) {
  const at = new Map();
  for (const e of metrics.evals || []) {
    const held = ['', 'heldout', 'validation'].includes(e.kind || '');
    if (held && !(at.get(Number(e.step))?.attempt > e.attempt)) at.set(Number(e.step), e);
  }
  return [...at.values()].sort((a, b) => Number(a.step) - Number(b.step));
}
const chartLine = (page, chart, label) => page.evaluate((c, l) =>
  window.loomConsole.charts[c]?.lines.find((x) => x.label === l), chart, label);

// A sweep's curves: each chart's lines are GET /v1/sweeps/{id}/curves (a cell's mean and 95%
// band; a difference's mean and paired-t band, then the zero line), for its metric and another;
// "Compare its jobs" opens the compare view with the sweep's jobs.
async function checkSweepCurves(page, base, token, sweepId) {
  const bands = (label, points) => [[label, 'mean'], [`${label} · 95% high`, 'ci_high'], [`${label} · 95% low`, 'ci_low']]
    .map(([l, k]) => ({ label: l, xs: points.map((p) => Number(p.step)), ys: points.map((p) => p[k] || 0) }));
  const bare = (lines) => lines.map(({ label, xs, ys }) => ({ label, xs, ys }));
  for (const metric of ['eval_loss', 'accuracy']) {
    if (metric !== 'eval_loss') await page.select('#curves-metric', metric);
    await page.waitForFunction((m) => window.loomConsole.charts.sweep_curves?.lines.length === 6 &&
      document.querySelector('#chart-sweep_curves figcaption').textContent.startsWith(m), { timeout: 15000 }, metric);
    const want = (await rest(base, token, 'GET', `/v1/sweeps/${sweepId}/curves?metric=${metric}`)).json;
    // 10 steps, evaluated at 0 and 10, each cell with both seeds.
    for (const c of want.cells) assert.deepEqual(c.points.map((p) => [Number(p.step), p.n]), [[0, 2], [10, 2]], c.cell);
    const shown = await page.evaluate(() => ({ cells: window.loomConsole.charts.sweep_curves.lines,
      diffs: window.loomConsole.charts.sweep_differences.lines }));
    assert.deepEqual(bare(shown.cells), want.cells.flatMap((c) => bands(c.cell, c.points)), `${metric}: cells`);
    assert.deepEqual(bare(shown.diffs.slice(0, -1)), want.differences.flatMap((d) => bands(`${d.cell} − ${d.baseline}`, d.points)),
      `${metric}: differences`);
    assert.deepEqual(bare(shown.diffs.slice(-1)), [{ label: 'zero', xs: [0, 10], ys: [0, 0] }]);
    if (metric !== 'eval_loss') continue;
    await checkChartsFit(page, 'a sweep\'s curves at 1280x800', 2);
    await checkTicks(page, 'sweep curves');
    const section = await page.$('section[aria-labelledby="h-sweep-curves"]');
    await section.screenshot({ path: path.join(out, 'sweep-curves.png') });
  }
  const sweepJobs = (await rest(base, token, 'GET', `/v1/sweeps/${sweepId}`)).json.jobs.map((j) => j.job_id);
  await page.click('#sweep-compare');
  await page.waitForFunction((n) => window.loomConsole.charts.compare_loss?.lines.length === n, { timeout: 15000 }, sweepJobs.length);
  assert.deepEqual((await page.evaluate(() => window.loomConsole.charts.compare_loss.lines.map((l) => l.label))).sort(), sweepJobs.sort());
  assert.match(await textOf(page, '#compare-legend'), /optimizer\.lr=0\.003, seed 2/);
}

// The compare view: opened from the jobs list's boxes and by URL; each job's line is what its
// metrics (fetched here) hold, the demo's tokens and FLOPs what the trainer logged; alignment,
// smoothing and log axes; an unknown id named and the rest drawn; more than 20 refused.
async function checkCompare(page, base, token, { demo, demoId, longId, ftId, logged }) {
  await page.goto(`${base}/#/jobs`);
  for (const id of [demoId, longId]) {
    await page.waitForSelector(`tr[data-job="${id}"] input.pick`);
    await page.click(`tr[data-job="${id}"] input.pick`);
  }
  await page.waitForFunction(() => /Compare 2 jobs/.test(document.querySelector('#compare').textContent));
  await page.click('#compare');
  await page.waitForFunction(() => location.hash.startsWith('#/compare?'));
  const picked = new URLSearchParams((await page.evaluate(() => location.hash)).split('?')[1]).get('jobs');
  assert.deepEqual(picked.split(',').sort(), [demoId, longId].sort());

  const ids = [demoId, longId, ftId];
  await page.goto(`${base}/#/compare?jobs=${ids},job-999999`);
  await page.waitForFunction(() => window.loomConsole.charts.compare_learning_rate?.lines.length === 3, { timeout: 15000 });
  assert.match(await textOf(page, '[data-problem="job-999999"]'), /^job-999999: no such job/);
  const legend = await page.$$eval('#compare-legend li', (els) => els.map((e) => e.textContent));
  assert.equal(legend.length, 3, legend.join('\n'));
  assert.match(legend[0], new RegExp(`^${demoId} tiny-iha · 4× iha \\(window \\d+, P 2\\)`));
  const metrics = {};
  for (const id of ids) metrics[id] = (await rest(base, token, 'GET', `/v1/jobs/${id}/metrics?max_points=2000`)).json;
  assert.equal(metrics[longId].series.length, 2, 'the restarted job has two attempts to join');
  for (const id of ids) {
    const steps = joinedSteps(metrics[id]), evals = heldOutEvals(metrics[id]);
    const loss = await chartLine(page, 'compare_loss', id), lr = await chartLine(page, 'compare_learning_rate', id);
    const evalLoss = await chartLine(page, 'compare_eval_loss', id);
    assert.deepEqual(loss.xs, steps.map((p) => Number(p.step)), `${id}: steps`);
    assert.deepEqual(loss.ys, steps.map((p) => p.loss || 0), `${id}: loss`);
    assert.deepEqual(lr.ys, steps.map((p) => p.learning_rate || 0), `${id}: learning rate`);
    assert.deepEqual(evalLoss ? [evalLoss.xs, evalLoss.ys] : [[], []],
      [evals.map((e) => Number(e.step)), evals.map((e) => e.eval_loss || 0)], `${id}: evals`);
  }
  await checkAlignment(page, ids, metrics, logged, demoId);
  await checkSmoothingAndLogAxes(page, demoId);
  // What a person sees, at the defaults: five charts inside their panels, nothing added by the
  // refreshes, distinct axis labels.
  await page.goto(`${base}/#/compare?jobs=${ids},job-999999`);
  await checkChartsFit(page, 'the compare view at 1280x800', 5);
  const before = await elementCounts(page);
  await sleep(10000);
  assert.deepEqual(await elementCounts(page), before, 'the compare view\'s refreshes changed its elements');
  await checkTicks(page, 'compare');
  await shot(page, 'compare', true);
  // A job without points (queued for a pool no worker is in): named when aligning by tokens, the
  // rest drawn, no error in the page.
  const queued = await rest(base, token, 'POST', '/v1/jobs',
    { ...demo, spec: { ...demo.spec, name: 'console-queued' }, pool: { pool: 'nowhere' } });
  assert.equal(queued.status, 201, queued.text);
  await page.goto(`${base}/#/compare?jobs=${demoId},${queued.json.id}&x=tokens`);
  await page.waitForSelector(`[data-problem="${queued.json.id}"]`);
  assert.match(await textOf(page, `[data-problem="${queued.json.id}"]`), /no tokens recorded/);
  assert.deepEqual(await page.evaluate(() => window.loomConsole.charts.compare_loss.lines.map((l) => l.label)), [demoId]);
  assert.equal((await rest(base, token, 'POST', `/v1/jobs/${queued.json.id}/cancel`)).status, 200);
  // More than 20 jobs: refused, nothing drawn.
  await page.goto(`${base}/#/compare?jobs=${Array.from({ length: 21 }, (_, i) => `job-${900001 + i}`)}`);
  await page.waitForSelector('[data-problem="refused"]');
  assert.match(await textOf(page, '[data-problem="refused"]'), /21 jobs named: at most 20/);
  assert.equal(await page.$$eval('figure.chart', (els) => els.length), 0);
  console.log(`ok: compare view of ${ids} checked against their metrics, by step, tokens and FLOPs`);
}
// Aligned by tokens and by training FLOPs: the x values are each point's tokens_seen and
// train_flops (the demo's exactly as its trainer logged them), positive and increasing, and
// FLOPs per token the same all along a job (3 x its forward FLOPs per token).
async function checkAlignment(page, ids, metrics, logged, demoId) {
  for (const [x, field, name] of [['tokens', 'tokens_seen', 'tokens'], ['flops', 'train_flops', 'training FLOPs']]) {
    await page.select('#compare-x', x);
    await page.waitForFunction((n) => window.loomConsole.charts.compare_loss?.x === n, { timeout: 5000 }, name);
    assert.match(await page.evaluate(() => location.hash), new RegExp(`[?&]x=${x}(&|$)`));
    for (const id of ids) {
      const line = await chartLine(page, 'compare_loss', id);
      assert.deepEqual(line.xs, joinedSteps(metrics[id]).map((p) => Number(p[field])), `${id} by ${x}`);
      line.xs.forEach((v, i) => assert.ok(v > 0 && (i === 0 || v > line.xs[i - 1]), `${id} by ${x}: ${v} at ${i}`));
    }
    const demo = await chartLine(page, 'compare_loss', demoId);
    assert.deepEqual(demo.xs, logged.map((e) => e[field]), `${demoId} by ${x}: as the trainer logged`);
  }
  for (const id of ids) {
    const per = joinedSteps(metrics[id]).map((p) => p.train_flops / Number(p.tokens_seen));
    per.forEach((f) => assert.ok(Math.abs(f - per[0]) <= 1e-9 * per[0], `${id}: FLOPs per token ${f} vs ${per[0]}`));
  }
}
// Smoothing is an exponential moving average of the raw values; log x leaves out step 0.
async function checkSmoothingAndLogAxes(page, demoId) {
  await page.select('#compare-x', 'step');
  await page.waitForFunction(() => window.loomConsole.charts.compare_loss?.x === 'step');
  const raw = (await chartLine(page, 'compare_loss', demoId)).ys;
  await page.$eval('#compare-smooth', (el) => { el.value = '0.5'; el.dispatchEvent(new Event('change')); });
  await page.waitForFunction(() => /smooth=0\.5/.test(location.hash));
  const smoothed = (await chartLine(page, 'compare_loss', demoId)).ys;
  let ema = raw[0];
  raw.forEach((y, i) => {
    ema = i ? 0.5 * ema + 0.5 * y : y;
    assert.ok(Math.abs(smoothed[i] - ema) <= 1e-12 * Math.abs(ema), `EMA at ${i}: ${smoothed[i]} vs ${ema}`);
  });
  assert.equal((await chartLine(page, 'compare_eval_loss', demoId)).xs[0], 0);
  await page.click('#compare-logx');
  await page.click('#compare-logy');
  await page.waitForFunction(() => /logx=1&logy=1/.test(location.hash));
  assert.ok((await chartLine(page, 'compare_eval_loss', demoId)).xs[0] > 0, 'log x: step 0 left out');
}

async function setEditor(page, text) {
  await page.$eval('#spec-editor', (el, v) => {
    el.value = v;
    el.dispatchEvent(new Event('input'));
  }, text);
}

async function main() {
  const { base, token, url } = await startLoomUp();
  console.log(`loom up: ${base}`);
  // The page holds no data: served without a token, while the API still wants one.
  const index = await rest(base, '', 'GET', '/');
  assert.equal(index.status, 200);
  assert.match(index.type, /^text\/html/);
  assert.match(index.csp, /script-src 'self'/);
  assert.equal((await rest(base, '', 'GET', '/console/nope.js')).status, 404);
  assert.equal((await rest(base, '', 'GET', '/v1/jobs')).status, 401);
  const demo = yaml.load(fs.readFileSync(path.join(source, 'examples/tiny-iha.yaml'), 'utf8'));
  demo.labels = { project: 'iha', stage: 'demo' };
  demo.description = 'the README demo';
  await waitFor('an alive worker', async () =>
    ((await rest(base, token, 'GET', '/v1/workers')).json.workers || []).some((w) => w.state === 'alive'));
  const submitted = await rest(base, token, 'POST', '/v1/jobs', demo);
  assert.equal(submitted.status, 201, submitted.text);
  const demoId = submitted.json.id;

  browser = await puppeteer.launch({ executablePath: chromium, headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'] });
  page = await browser.newPage();
  await page.setViewport({ width: 1280, height: 800 });
  page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
  page.on('console', (m) => {
    // A refused request (the invalid spec's 400) is logged by Chromium; everything else is a bug.
    if (m.type() === 'error' && !/Failed to load resource/.test(m.text())) problems.push(m.text());
  });
  page.on('request', (r) => requests.push({ url: r.url(), method: r.method(), headers: r.headers() }));

  // Log in: a wrong token is refused on the form; the URL `loom up` printed logs in.
  await page.goto(`${base}/`);
  await page.waitForSelector('#token');
  await page.type('#token', 'not-a-valid-token-0000');
  await page.click('form button[type=submit]');
  await page.waitForFunction(() => document.querySelector('#login-error').textContent.length > 0);
  assert.match(await textOf(page, '#login-error'), /invalid token/);
  await shot(page, 'login');
  const loggedInAt = requests.length;  // before: the wrong token's one check
  await page.goto(url);
  await page.waitForSelector(`tr[data-job="${demoId}"]`);
  assert.equal(await page.evaluate(() => location.hash), '#/jobs', 'the token is dropped from the URL');
  assert.equal(await page.evaluate(() => sessionStorage.getItem('loom.token')), token);
  assert.equal(await page.evaluate(() => document.cookie), '');
  assert.match(await textOf(page, `tr[data-job="${demoId}"]`), /tiny-iha/);
  await shot(page, 'jobs');
  // The label filter: the demo job matches project=iha, nothing matches project=mha.
  await page.goto(`${base}/#/jobs?label=project%3Dmha`);
  await page.waitForFunction(() => /No jobs/.test(document.querySelector('#jobs').textContent), { timeout: 10000 });
  assert.equal(await page.$eval('#filter-label', (e) => e.value), 'project=mha');
  await page.goto(`${base}/#/jobs?label=project%3Diha`);
  await page.waitForSelector(`tr[data-job="${demoId}"]`);
  await page.goto(`${base}/#/jobs`);
  await page.waitForSelector(`tr[data-job="${demoId}"]`);

  // The job page: the log is followed while the job runs, to its last line.
  await page.click(`tr[data-job="${demoId}"] a`);
  await page.waitForSelector('#chart-loss');
  await checkChartsFit(page, 'the running job at 1280x800');
  await waitFor('log lines', () => page.$eval('#log', (el) => /\[rank 0\]/.test(el.textContent)));
  const early = (await textOf(page, '#log')).length;
  await shot(page, 'job-running');
  await waitFor('the demo job to succeed', async () =>
    (await rest(base, token, 'GET', `/v1/jobs/${demoId}`)).json.state === 'succeeded', 400000);
  await waitFor('the end of the log', () => page.$eval('#log-status', (el) => /end of log/.test(el.textContent)), 30000);
  const log = await textOf(page, '#log');
  assert.ok(log.length > early, 'the followed log grew');
  assert.match(log, /\[agent local-0\] rank 0 exited 0/, 'the followed log reached the last line');
  await waitFor('the final state on the page', () => page.$eval('.job-head', (el) => /succeeded/.test(el.textContent)), 10000);
  const summaryText = await page.$eval('dl.summary', (el) => el.innerText);
  assert.match(summaryText, /Labels\s+project=iha, stage=demo/);
  assert.match(summaryText, /About\s+the README demo/);

  // The chart holds exactly what rank 0 logged: every step's loss, and the evaluations.
  const job = (await rest(base, token, 'GET', `/v1/jobs/${demoId}`)).json;
  // The worker agent's copy of rank 0's JSONL (its work dir, as `loom up` lays it out).
  const jsonl = path.join(tmp, 'up', 'worker-0', 'jobs', demoId, 'attempt-001', 'metrics.jsonl');
  const logged = fs.readFileSync(jsonl, 'utf8').split('\n').filter(Boolean)
    .map((l) => JSON.parse(l)).filter((e) => e.event === 'step');
  assert.equal(logged.length, 150);
  await waitFor('all points drawn', () => page.evaluate((n) =>
    (window.loomConsole.charts.loss?.lines?.[0]?.xs.length || 0) === n, logged.length), 10000);
  const chart = await page.evaluate(() => window.loomConsole.charts.loss.lines);
  const train = chart.find((l) => l.label === 'attempt 1');
  assert.deepEqual(train.xs, logged.map((e) => e.step));
  train.ys.forEach((y, i) => assert.ok(Math.abs(y - logged[i].loss) <= 1e-8 * Math.abs(logged[i].loss),
    `step ${logged[i].step}: chart ${y} vs logged ${logged[i].loss}`));
  const evalLine = chart.find((l) => l.label === 'eval loss · attempt 1');
  assert.deepEqual(evalLine.xs, job.evals.filter((e) => e.kind !== 'reasoning').map((e) => Number(e.step)));
  const lr = await page.evaluate(() => window.loomConsole.charts.learning_rate.lines[0]);
  lr.ys.forEach((y, i) => assert.ok(Math.abs(y - logged[i].lr) <= 1e-8 * logged[i].lr + 1e-15));
  // uPlot's own data: the x values are the logged steps and the evaluations' steps.
  const uplotX = await page.evaluate(() => Array.from(window.loomConsole.charts.loss.data[0]));
  const steps = [...new Set([...train.xs, ...evalLine.xs])].sort((a, b) => a - b);
  assert.deepEqual(uplotX, steps, 'uPlot was given every step');
  assert.match(await textOf(page, '#timeline'), /checkpoint at step 150/);
  assert.doesNotMatch(await textOf(page, '#timeline'), /#-/, 'an event without an attempt shows none');
  // Ten seconds (five refreshes) on the finished job's page change none of its elements; the
  // resolved spec is there once; every chart's axis labels can be told apart.
  const before = await elementCounts(page);
  await sleep(10000);
  assert.deepEqual(await elementCounts(page), before, 'the refreshes changed the page\'s elements');
  assert.equal(await page.$$eval('details.spec', (els) => els.length), 1);
  const ids = await page.$$eval('[id]', (els) => els.map((e) => e.id));
  assert.equal(new Set(ids).size, ids.length, `ids repeated: ${ids}`);
  const ticks = await page.evaluate(() => Object.fromEntries(Object.entries(window.loomConsole.charts)
    .map(([name, c]) => [name, (c.ticks || []).filter(Boolean)])));
  for (const [name, shown] of Object.entries(ticks)) {
    assert.equal(new Set(shown).size, shown.length, `${name}: axis labels ${shown}`);
  }
  assert.ok(ticks.learning_rate.length >= 3, `learning-rate axis labels: ${ticks.learning_rate}`);
  await shot(page, 'job', true);
  console.log(`ok: chart = ${logged.length} logged steps, log followed to its end`);

  // Submit: an invalid spec gets the coordinator's field error next to the line it names.
  await page.goto(`${base}/#/submit`);
  await page.waitForSelector('#spec-editor');
  const bad = yaml.dump({ ...demo, spec: { ...demo.spec, name: 'console-bad', optimizer: { lr: -0.5 } } });
  await setEditor(page, bad);
  await page.click('#submit');
  await page.waitForSelector('.note.field-error');
  const note = await page.$eval('.note.field-error', (el) => ({ field: el.dataset.field, text: el.textContent,
    top: el.getBoundingClientRect().top }));
  assert.equal(note.field, 'spec.optimizer.lr');
  assert.match(note.text, /spec\.optimizer\.lr: must be in \(0, 10\]/);
  const lrLine = bad.split('\n').findIndex((l) => /^\s*lr:/.test(l)) + 1;
  const marked = await page.$$eval('.gutter .bad', (els) => els.map((e) => Number(e.dataset.line)));
  assert.deepEqual(marked, [lrLine]);
  const lineTop = await page.$eval(`.gutter [data-line="${lrLine}"]`, (el) => el.getBoundingClientRect().top);
  assert.ok(Math.abs(note.top - lineTop) < 12, `the note sits next to line ${lrLine}`);
  await shot(page, 'submit-error');

  // A valid one is queued and shown.
  const long = yaml.dump({ ...demo, spec: { ...demo.spec, name: 'console-long', steps: 100000,
    checkpoint: { interval: 20, keep_last: 1 }, eval: { interval: 100000, batches: 1 } } });
  await setEditor(page, long);
  await page.click('#submit');
  await page.waitForFunction(() => /^#\/jobs\/job-/.test(location.hash));
  const longId = decodeURIComponent((await page.evaluate(() => location.hash)).split('/')[2]);
  const stepOf = async () => Number((await rest(base, token, 'GET', `/v1/jobs/${longId}`)).json.progress?.step || 0);
  await waitFor('the long job past its first checkpoint', async () => (await stepOf()) >= 30, 120000);
  // The worker page shows the attempt running there.
  await page.goto(`${base}/#/workers`);
  await page.waitForFunction((id) => [...document.querySelectorAll('tr[data-worker] td')]
    .some((td) => td.textContent.includes(id)), { timeout: 10000 }, longId);
  assert.match(await textOf(page, 'tr[data-worker]'), /pool=cpu/);
  // Quotas and fair-share weights an admin set (loom up's user is one) are listed there too.
  assert.equal((await rest(base, token, 'PUT', '/v1/quotas/user/local', { slots: 8, weight: 2 })).status, 200);
  await page.waitForFunction(() => /1 of 8|2 of 8/.test(document.querySelector('tr[data-quota="user/local"]')?.textContent || ''),
    { timeout: 15000 });
  assert.match(await textOf(page, 'tr[data-quota="user/local"]'), /user.*local.*of 8.*2/);
  await shot(page, 'workers');
  assert.equal((await rest(base, token, 'DELETE', '/v1/quotas/user/local')).status, 200);
  // A rank dies (SIGKILL): attempt 2 resumes from the newest checkpoint (step 20, or 40 when the
  // job got there before the kill) and draws its own line from there; neither line goes back
  // over itself.
  // (The full path: other suites running at the same time have jobs with the same id.)
  const killed = spawn('pkill', ['-KILL', '-f', path.join(tmp, 'up', 'worker-0', 'jobs', longId, 'attempt-001/')]);
  assert.equal(await new Promise((r) => killed.once('exit', r)), 0, 'pkill found the rank');
  await page.goto(`${base}/#/jobs/${longId}`);
  await page.waitForFunction(() => (window.loomConsole.charts.loss?.lines || [])
    .some((l) => l.label === 'attempt 2' && l.xs.length >= 5), { timeout: 120000 });
  const lines = await page.evaluate(() => window.loomConsole.charts.loss.lines.filter((l) => !l.dashed));
  assert.deepEqual(lines.map((l) => l.label), ['attempt 1', 'attempt 2']);
  for (const l of lines) l.xs.forEach((x, i) => i && assert.ok(x > l.xs[i - 1], `${l.label} goes back at ${x}`));
  const [a1, a2] = lines;
  const events = (await rest(base, token, 'GET', `/v1/jobs/${longId}`)).json.events || [];
  const resumed = events.map((e) => /attempt 2 .*resuming from step (\d+)/.exec(e.reason || '')).find(Boolean);
  assert.ok(resumed, 'attempt 2 was placed to resume from a checkpoint');
  const from = Number(resumed[1]);
  assert.ok(from >= 20 && from % 20 === 0, `resumed from a checkpoint step (${from})`);
  assert.equal(a2.xs[0], from + 1, `attempt 2's line starts right after the checkpoint at step ${from}`);
  assert.ok(a1.xs[a1.xs.length - 1] >= 30, 'attempt 1 got past step 30 before it died');
  await page.waitForFunction(() => /resumed from/.test(document.querySelector('#timeline').textContent), { timeout: 10000 });
  await page.$eval('#chart-loss', (el) => el.scrollIntoView());
  await shot(page, 'job-restarted');
  // Its cancel button cancels it.
  await page.click('#cancel');
  await page.waitForFunction(() => /cancelled/.test(document.querySelector('.job-head')?.textContent || ''),
    { timeout: 60000 });
  assert.equal((await rest(base, token, 'GET', `/v1/jobs/${longId}`)).json.state, 'cancelled');
  await shot(page, 'job-cancelled');

  // Fine-tune from the demo's last checkpoint: the form is pre-filled with it.
  await page.goto(`${base}/#/checkpoints`);
  const last = `${demoId}.150`;
  await page.waitForSelector(`a[data-finetune="${last}"]`);
  await shot(page, 'checkpoints');
  await page.click(`a[data-finetune="${last}"]`);
  await page.waitForFunction((id) => document.querySelector('#spec-editor')?.value.includes(`init_from: ${id}`),
    { timeout: 10000 }, last);
  const prefilled = yaml.load(await page.$eval('#spec-editor', (el) => el.value));
  assert.equal(prefilled.init_from, last);
  assert.equal(prefilled.spec.name, 'tiny-iha-ft');
  assert.deepEqual(prefilled.spec.model, demo.spec.model);
  await shot(page, 'submit-finetune');
  const sft = yaml.load(fs.readFileSync(path.join(source, 'examples/tiny-sft.yaml'), 'utf8'));
  const ft = { ...prefilled, spec: { ...sft.spec, name: 'tiny-sft-console', steps: 10,
    checkpoint: { interval: 10, keep_last: 1 }, eval: { interval: 10, batches: 1 },
    reasoning_eval: { problems: 2, samples: 2, generation: { max_new_tokens: 24 } } } };
  await setEditor(page, yaml.dump(ft));
  await page.click('#submit');
  await page.waitForFunction((old) => /^#\/jobs\/job-/.test(location.hash) && !location.hash.endsWith(old),
    {}, longId);
  const ftId = decodeURIComponent((await page.evaluate(() => location.hash)).split('/')[2]);
  await waitFor('the fine-tune to succeed', async () =>
    (await rest(base, token, 'GET', `/v1/jobs/${ftId}`)).json.state === 'succeeded', 300000);
  await page.waitForFunction(() => /Pass@1/.test(document.body.textContent), { timeout: 10000 });
  await clickLive(page, '.job-head a[href^="#/lineage/"]');
  await page.waitForSelector(`[data-node="${ftId}"]`);
  await page.waitForFunction((a, b) => !!document.querySelector(`[data-edge="${a}->${b}"]`) &&
    /checkpoints: 10/.test(document.querySelector(`[data-node="${b}"]`).textContent), { timeout: 15000 }, demoId, ftId);
  const nodes = await page.$$eval('[data-node]', (els) => els.map((e) => e.dataset.node).sort());
  assert.deepEqual(nodes, [demoId, ftId].sort(), 'the lineage of the fine-tune: its parent and itself');
  assert.match(await textOf(page, `[data-edge="${demoId}->${ftId}"]`), new RegExp(`checkpoint ${last}`));
  await shot(page, 'lineage');
  console.log(`ok: fine-tune ${ftId} from ${last}, lineage drawn`);

  // A sweep: 2 learning rates x 2 paired seeds, run while the phone-width checks go on.
  const tiny = { ...demo.spec, steps: 10, checkpoint: { interval: 10, keep_last: 1 }, eval: { interval: 10, batches: 2 } };
  const sweep = await rest(base, token, 'POST', '/v1/sweeps', { name: 'console-lr', base: { ...demo, spec: tiny },
    grid: { 'optimizer.lr': [0.001, 0.003] }, seeds: [1, 2] });
  assert.equal(sweep.status, 201, sweep.text);

  // The phone width: nothing wider than the screen, every control labelled.
  await page.setViewport({ width: 390, height: 844 });
  const compared = [demoId, longId, ftId];
  for (const [view, name] of [['#/jobs', 'phone-jobs'], [`#/jobs/${demoId}`, 'phone-job'], ['#/submit', 'phone-submit'],
    [`#/compare?jobs=${compared}`, 'phone-compare']]) {
    await page.goto(`${base}/${view}`);
    await page.waitForSelector('#page-title');
    if (name === 'phone-job') await checkChartsFit(page, 'a job at 390 px');
    if (name === 'phone-compare') await checkChartsFit(page, 'the compare view at 390 px', 5);
    await sleep(800);
    const width = await page.evaluate(() => document.documentElement.scrollWidth);
    assert.ok(width <= 391, `${view} is ${width}px wide at phone width`);
    const unlabelled = await page.$$eval('input, select, textarea', (els) => els.filter((e) =>
      !e.getAttribute('aria-label') && !(e.id && document.querySelector(`label[for="${e.id}"]`))).map((e) => e.outerHTML));
    assert.deepEqual(unlabelled, [], `${view}: controls without a label`);
    await shot(page, name);
  }
  await page.setViewport({ width: 1280, height: 800 });
  // Keyboard: the skip link comes first; from a page's heading Tab reaches its first control;
  // Enter on a focused job link opens the job.
  assert.equal(await page.evaluate(() =>
    document.querySelector('a[href], button, input, select, textarea, [tabindex]:not([tabindex="-1"])').className), 'skip');
  await page.goto(`${base}/#/jobs`);
  await page.waitForSelector(`tr[data-job="${demoId}"] a`);
  assert.equal(await page.evaluate(() => document.activeElement.id), 'page-title');
  await page.keyboard.press('Tab');
  assert.equal(await page.evaluate(() => document.activeElement.id), 'filter-state');
  await page.focus(`tr[data-job="${demoId}"] a`);
  await page.keyboard.press('Enter');
  await page.waitForFunction((id) => location.hash === `#/jobs/${id}`, { timeout: 5000 }, demoId);

  // The sweep's report: both cells with their 95% intervals, the paired difference.
  await waitFor('the sweep to finish', async () =>
    (await rest(base, token, 'GET', `/v1/sweeps/${sweep.json.id}`)).json.state === 'finished', 180000);
  await page.goto(`${base}/#/sweeps/${sweep.json.id}`);
  // The report's tables, not the curves' chart legends (uPlot draws those as tables too, and the
  // curves may arrive first).
  const reportTables = 'main table:not(.u-legend)';
  await page.waitForFunction((sel) => document.querySelectorAll(sel).length >= 2 &&
    /complete/.test(document.querySelector('main').textContent), { timeout: 15000 }, reportTables);
  const [cells, diffs] = await page.$$eval(reportTables, (ts) => ts.map((t) => [...t.tBodies[0].rows].map((r) => r.innerText)));
  assert.equal(cells.length, 2, cells.join('\n'));
  for (const c of cells) assert.match(c, /\t2\t0\t0\t[-\d.e]+\t\[[-\d.e]+, [-\d.e]+\]/, c);
  assert.equal(diffs.length, 1);
  assert.match(diffs[0], /^optimizer.lr=0.003\toptimizer.lr=0.001\t2\t/);
  await shot(page, 'sweep');
  await checkSweepCurves(page, base, token, sweep.json.id);
  await checkCompare(page, base, token, { demo, demoId, longId, ftId, logged });

  // Every API request the page made carried the user's token; nothing else was fetched.
  const isApi = (r) => new URL(r.url).pathname.startsWith('/v1/');
  const api = requests.slice(loggedInAt).filter(isApi);
  assert.deepEqual(requests.slice(0, loggedInAt).filter(isApi).map((r) => r.headers.authorization),
    ['Bearer not-a-valid-token-0000']);
  assert.ok(api.length > 20);
  for (const r of requests) {
    const u = new URL(r.url);
    assert.equal(u.origin, base, `request to another origin: ${r.url}`);
    assert.ok(u.pathname === '/' || u.pathname.startsWith('/console/') || u.pathname.startsWith('/v1/'), r.url);
  }
  for (const r of api) assert.equal(r.headers.authorization, `Bearer ${token}`, `${r.method} ${r.url}`);
  assert.deepEqual(problems, [], 'console errors or CSP violations in the page');
  console.log(`ok: ${requests.length} requests, ${api.length} to the API, all with the bearer token; screenshots in ${out}`);
}

main().then(async () => {
  clearTimeout(deadline);
  await cleanup();
  console.log('PASS console_test');
}, async (e) => {
  clearTimeout(deadline);
  console.error(`FAIL: ${e.stack || e}`);
  if (problems.length) console.error(`page problems:\n  ${problems.join('\n  ')}`);
  if (page) await shot(page, 'failure').catch(() => {});
  await cleanup();
  process.exit(1);
});
