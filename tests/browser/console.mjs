// Drives Flotilla's web console in headless Chromium (Debian's, through
// Playwright's executablePath) as a tenant, a second tenant, an operator
// and a provider would. Started by crates/cli/tests/console.rs, which runs
// a real server and agent with simulated GPUs and passes, in the
// environment: FLOTILLA_URL, the keys (OP_KEY, A_KEY, B_KEY, and the
// agent's PROVIDER_KEY), GATEWAY (`flotilla gateway`'s URL), BIN (the
// flotilla binary, an endpoint replica runs its emulator), SHOTS (where
// screenshots go), CHROMIUM, and NODE_NAME (the agent's node). Each step
// asserts what a person would see; the first failure exits non-zero. On
// success it prints one JSON line of what it made, for the Rust test to
// check through the API.
import assert from 'node:assert/strict';
import { readFileSync, mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const env = (k) => { const v = process.env[k]; if (!v) { throw new Error(`${k} is not set`); } return v; };
const URL0 = env('FLOTILLA_URL');
const SHOTS = env('SHOTS');
const LONG = Number(process.env.STEP_TIMEOUT_MS || 120_000);
mkdirSync(SHOTS, { recursive: true });

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-dev-shm-usage'],
});
const made = {};
const step = (name) => console.error(`console test: ${name}`);

async function session(key, viewport = { width: 1280, height: 860 }) {
  const ctx = await browser.newContext({ viewport, acceptDownloads: true });
  const page = await ctx.newPage();
  page.setDefaultTimeout(LONG);
  await page.goto(`${URL0}/login`);
  await page.getByLabel('API key').fill(key);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.waitForURL((u) => !u.pathname.startsWith('/login'));
  return { ctx, page };
}

async function shot(page, name) {
  await page.screenshot({ path: join(SHOTS, `${name}.png`), fullPage: true });
}

try {
  // --- Sign in: a wrong key is refused, the cookie is HttpOnly and Strict.
  step('sign in');
  {
    const ctx = await browser.newContext();
    const page = await ctx.newPage();
    await page.goto(`${URL0}/login`);
    await shot(page, 'login');
    await page.getByLabel('API key').fill('flt_' + '0'.repeat(64));
    await page.getByRole('button', { name: 'Sign in' }).click();
    await page.locator('#login-error').waitFor();
    assert.match(await page.locator('#login-error').innerText(), /not valid/);
    // A form post without the sign-in token is refused (CSRF).
    const forged = await page.request.post(`${URL0}/logout`, { form: { csrf: 'x' }, maxRedirects: 0 });
    assert.ok([303, 401].includes(forged.status()), `logout without a session: ${forged.status()}`);
    await ctx.close();
  }
  const a = await session(env('A_KEY'));
  const cookies = await a.ctx.cookies();
  const sc = cookies.find((c) => c.name === 'flotilla_session');
  assert.ok(sc, 'a session cookie');
  assert.equal(sc.httpOnly, true);
  assert.equal(sc.sameSite, 'Strict');
  // A form post with the right cookie but no CSRF token is refused.
  const noToken = await a.page.request.post(`${URL0}/instances`, { form: { gpus: '1', command: 'true' }, maxRedirects: 0 });
  assert.equal(noToken.status(), 403, 'a form without its CSRF token');

  // --- GPU catalog with availability and prices.
  step('catalog');
  await a.page.goto(`${URL0}/gpus`);
  const h100 = a.page.locator('tr[data-model="H100"]');
  await h100.waitFor();
  assert.match(await h100.locator('td.free').innerText(), /\d+ \/ \d+/);
  assert.doesNotMatch(await a.page.locator('#catalog').innerText(), /0\.000416666666/);
  await shot(a.page, 'gpus');

  // --- Launch an instance, see it running, read its logs, stop it.
  step('launch an instance');
  await a.page.goto(`${URL0}/instances`);
  await a.page.getByLabel('Name (optional)').fill('hello');
  await a.page.getByLabel('GPU model').selectOption('H100');
  await a.page.getByLabel('Whole GPUs').fill('1');
  await a.page.getByLabel('Billing class').selectOption('on_demand');
  await a.page.getByLabel('Command (run with sh -c)').fill('for i in 1 2 3; do echo "console-line-$i $GREETING"; done; sleep 600');
  await a.page.getByLabel('Environment (KEY=VALUE per line)').fill('GREETING=hi-from-the-console');
  await a.page.getByRole('button', { name: 'Launch' }).click();
  await a.page.waitForURL(/\/instances\/inst_/);
  made.instance = a.page.url().split('/').pop();
  await a.page.locator('#state', { hasText: 'running' }).waitFor();
  await a.page.locator('#logs', { hasText: 'console-line-3 hi-from-the-console' }).waitFor();
  await shot(a.page, 'instance');
  await a.page.goto(`${URL0}/instances`);
  await a.page.locator(`tr[data-instance="${made.instance}"]`, { hasText: 'running' }).waitFor();
  await shot(a.page, 'instances');
  await a.page.goto(`${URL0}/instances/${made.instance}`);

  // --- The terminal tab runs a command inside the running instance (a
  // shell on a pseudo-terminal over the console's WebSocket), shows the
  // exit code when the shell ends, and reconnects. Entering an instance
  // needs an agent running as root (TERMINAL=1 says it is).
  if (process.env.TERMINAL === '1') {
    step('the terminal tab runs a command');
    await a.page.getByRole('tab', { name: 'Terminal' }).click();
    await a.page.getByRole('heading', { name: 'Terminal' }).waitFor();
    const status = a.page.locator('#terminal-status');
    await a.page.locator('#terminal-status[data-state="connected"]').waitFor();
    // The shell's prompt (the workload's user is never root: `$`).
    await a.page.locator('#terminal .xterm-rows', { hasText: '$' }).waitFor();
    await a.page.locator('#terminal .xterm').click();
    await a.page.keyboard.type('echo term-$((6*7))');
    await a.page.keyboard.press('Enter');
    await a.page.locator('#terminal .xterm-rows', { hasText: 'term-42' }).waitFor();
    const wide = await a.page.evaluate(() => document.documentElement.scrollWidth);
    assert.ok(wide <= 1280, `the terminal tab is ${wide} px wide on a 1280-pixel screen`);
    await shot(a.page, 'terminal');
    await a.page.keyboard.type('exit 3');
    await a.page.keyboard.press('Enter');
    await a.page.locator('#terminal-status[data-state="ended"]', { hasText: 'exit code 3' }).waitFor();
    await a.page.getByRole('button', { name: 'Reconnect' }).click();
    await a.page.locator('#terminal-status[data-state="connected"]').waitFor();
    await a.page.locator('#terminal .xterm-rows', { hasText: '$' }).waitFor();
    await a.page.locator('#terminal .xterm').click();
    await a.page.keyboard.type('echo again-$((2+3))');
    await a.page.keyboard.press('Enter');
    await a.page.locator('#terminal .xterm-rows', { hasText: 'again-5' }).waitFor();
    assert.match(await status.innerText(), /Connected/);
    // A request from another origin, or without the page's token, is
    // refused before the handshake is even looked at (cross-site
    // WebSocket hijacking): the cookie alone opens nothing.
    const csrf = await a.page.locator('#terminal').getAttribute('data-csrf');
    const foreign = await a.page.request.get(`${URL0}/instances/${made.instance}/terminal?csrf=${csrf}`,
      { headers: { origin: 'http://evil.example' }, maxRedirects: 0 });
    assert.equal(foreign.status(), 403, 'a terminal handshake from another origin');
    const tokenless = await a.page.request.get(`${URL0}/instances/${made.instance}/terminal`,
      { headers: { origin: new URL(URL0).origin }, maxRedirects: 0 });
    assert.equal(tokenless.status(), 403, 'a terminal handshake without the CSRF token');
    await a.page.getByRole('tab', { name: 'Logs' }).click();
  } else {
    step('the terminal tab: skipped, the agent does not run as root');
  }
  await a.page.getByRole('button', { name: 'Stop instance' }).click();
  await a.page.locator('#state', { hasText: 'stopped' }).waitFor();
  // A stopped instance's terminal tab says why there is none.
  await a.page.goto(`${URL0}/instances/${made.instance}`);
  await a.page.getByRole('tab', { name: 'Terminal' }).click();
  await a.page.locator('#terminal-why', { hasText: 'only a running instance' }).waitFor();

  // --- A share of one GPU reads as a share (as `flotilla ps` writes it),
  // in the list and on its page, and the list fits a 1280-pixel screen.
  step('a share shown as a share');
  {
    const r = await a.page.request.post(`${URL0}/v1/instances`, {
      headers: { authorization: `Bearer ${env('A_KEY')}` },
      data: { gpus: 1, gpu_fraction: 0.25, gpu_types: ['L40S'], command: ['sleep', '600'], name: 'quarter' },
    });
    assert.equal(r.status(), 201, `create a quarter-GPU instance: ${r.status()}`);
    made.share = (await r.json()).id;
    await a.page.goto(`${URL0}/instances`);
    const row = a.page.locator(`tr[data-instance="${made.share}"]`);
    await row.waitFor();
    assert.equal((await row.locator('td.gpus').innerText()).trim(), '0.25 × L40S');
    const wide = await a.page.evaluate(() => document.documentElement.scrollWidth);
    assert.ok(wide <= 1280, `the instance list is ${wide} px wide on a 1280-pixel screen`);
    await a.page.goto(`${URL0}/instances/${made.share}`);
    assert.equal((await a.page.locator('#gpus').innerText()).trim(), '0.25 × L40S');
    const stop = await a.page.request.post(`${URL0}/v1/instances/${made.share}/stop`, {
      headers: { authorization: `Bearer ${env('A_KEY')}` },
    });
    assert.ok(stop.ok(), `stop the share: ${stop.status()}`);
  }

  // --- Deploy an endpoint and see its replica chart.
  step('deploy an endpoint');
  await a.page.goto(`${URL0}/endpoints`);
  await a.page.getByLabel('Name (a DNS label)').fill('chat');
  await a.page.getByLabel(/Replica command/).fill(`exec ${env('BIN')} emulator --port "$PORT" --model chat`);
  await a.page.getByLabel(/Model names/).fill('chat');
  await a.page.getByLabel(/Share of one GPU/).fill('0.5');
  await a.page.getByLabel('Min replicas').fill('1');
  await a.page.getByLabel('Max replicas').fill('2');
  await a.page.getByLabel('SLO p95 (ms)').fill('2000');
  await a.page.getByRole('button', { name: 'Deploy' }).click();
  await a.page.waitForURL(/\/endpoints\/ep_/);
  made.endpoint = a.page.url().split('/').pop();
  const chart = a.page.locator('#replica-chart');
  await chart.locator('canvas').waitFor();
  // The chart's data shows a ready replica once the emulator answers.
  await a.page.waitForFunction(async (url) => {
    const r = await fetch(url, { credentials: 'same-origin' });
    const b = await r.json();
    return b.points.some((p) => p.ready >= 1);
  }, `/endpoints/${made.endpoint}/series`, { timeout: LONG, polling: 2000 });
  await a.page.waitForFunction(() => Number(document.querySelector('#replica-chart').getAttribute('data-points')) >= 3,
    null, { timeout: LONG, polling: 1000 });
  await a.page.locator('#ready-replicas', { hasText: /^[1-9]/ }).waitFor();
  // Traffic through the gateway (bounded: 4 requests a second for 15 s),
  // then the chart shows requests per second and a p95 against the SLO.
  const gw = env('GATEWAY');
  let served = 0;
  for (let i = 0; i < 60; i++) {
    const r = await fetch(`${gw}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'authorization': `Bearer ${env('A_KEY')}`, 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'chat', messages: [{ role: 'user', content: 'hello' }], max_tokens: 4 }),
    }).catch(() => null);
    if (r && r.ok) { served++; }
    await new Promise((res) => setTimeout(res, 250));
  }
  assert.ok(served >= 50, `the gateway served ${served} of 60 requests`);
  await a.page.waitForFunction(async (url) => {
    const b = await (await fetch(url, { credentials: 'same-origin' })).json();
    return b.points.some((p) => p.rps > 0) && b.points.some((p) => p.p95_ms !== null);
  }, `/endpoints/${made.endpoint}/series`, { timeout: LONG, polling: 2000 });
  made.served = served;
  await shot(a.page, 'endpoint');

  // --- Usage and invoices: open this month's invoice, download its CSV.
  step('invoice and CSV');
  await a.page.goto(`${URL0}/billing`);
  await a.page.locator('#cost-chart canvas').waitFor();
  await shot(a.page, 'billing');
  // The stopped instance's GPU time is metered within a sync or two.
  const deadline = Date.now() + LONG;
  for (;;) {
    await a.page.locator('#open-draft').click();
    await a.page.waitForURL(/\/invoices\/draft\//);
    const rows = await a.page.locator('table tbody tr td.empty').count();
    if (rows === 0) { break; }
    assert.ok(Date.now() < deadline, 'usage reached the invoice');
    await a.page.waitForTimeout(2000);
    await a.page.goto(`${URL0}/billing`);
  }
  const total = await a.page.locator('#invoice-total').innerText();
  assert.match(total, /^\d+\.\d{2} [A-Z]{3}$/);
  const lineCount = await a.page.locator('table tbody tr').count();
  await shot(a.page, 'invoice');
  const [download] = await Promise.all([
    a.page.waitForEvent('download'),
    a.page.locator('#download-csv').click(),
  ]);
  const csv = readFileSync(await download.path(), 'utf8').trim().split('\n');
  assert.match(csv[0], /unit_price/, `a CSV header: ${csv[0]}`);
  assert.equal(csv.length - 1, lineCount, 'one CSV row per invoice line');
  assert.match(csv.slice(1).join('\n'), /H100/);
  made.csv_rows = csv.length - 1;

  // --- Budget, keys and estimator pages render for the tenant.
  step('budget, keys, estimator');
  await a.page.goto(`${URL0}/budget`);
  await a.page.getByLabel('Limit').fill('250');
  await a.page.getByRole('button', { name: 'Save budget' }).click();
  await a.page.locator('#spend').waitFor();
  await a.page.goto(`${URL0}/estimate?model=H100&gpus=2&hours_per_day=8&tier=2`);
  await a.page.locator('table', { hasText: 'reserved 365 days, 35% off' }).waitFor();
  await a.page.locator('table', { hasText: 'on demand' }).waitFor();
  await shot(a.page, 'estimate');

  // --- Provider: an offer window that excludes now keeps new work off
  // the node; offering it again lets the work start.
  step('provider offer window');
  const prov = await session(env('PROVIDER_KEY'));
  await prov.page.goto(`${URL0}/provider`);
  const offer = prov.page.locator(`section.offer[data-name="${env('NODE_NAME')}"]`);
  await offer.waitFor();
  const hhmm = (d) => d.toISOString().slice(11, 16);
  const later = new Date(Date.now() + 2 * 3600_000);
  const window = `${hhmm(later)}-${hhmm(new Date(later.getTime() + 3600_000))}`;
  await offer.getByLabel(`Offer windows of ${env('NODE_NAME')}`).fill(window);
  await offer.getByRole('button', { name: `Save windows of ${env('NODE_NAME')}` }).click();
  await prov.page.locator(`section.offer[data-name="${env('NODE_NAME')}"] .offered`, { hasText: 'no' }).waitFor();
  await shot(prov.page, 'provider');
  await a.page.goto(`${URL0}/instances`);
  await a.page.getByLabel('Name (optional)').fill('outside-window');
  await a.page.getByLabel('GPU model').selectOption('H100');
  await a.page.getByLabel('Command (run with sh -c)').fill('echo offered; sleep 600');
  await a.page.getByRole('button', { name: 'Launch' }).click();
  await a.page.waitForURL(/\/instances\/inst_/);
  made.outside = a.page.url().split('/').pop();
  await a.page.locator('#summary', { hasText: 'cordoned' }).waitFor();
  assert.match(await a.page.locator('#state').innerText(), /pending/);
  // The window is the node's whole offer again: no lines, always offered.
  await prov.page.goto(`${URL0}/provider`);
  await offer.getByLabel(`Offer windows of ${env('NODE_NAME')}`).fill('');
  await offer.getByRole('button', { name: `Save windows of ${env('NODE_NAME')}` }).click();
  await prov.page.locator(`section.offer[data-name="${env('NODE_NAME')}"] .offered`, { hasText: 'yes' }).waitFor();
  await prov.ctx.close();
  await a.page.goto(`${URL0}/instances/${made.outside}`);
  await a.page.locator('#state', { hasText: 'running' }).waitFor();
  await a.page.getByRole('button', { name: 'Stop instance' }).click();
  await a.page.locator('#state', { hasText: 'stopped' }).waitFor();

  // --- Tenant B sees none of A's objects, by page or by URL.
  step('isolation');
  const b = await session(env('B_KEY'));
  for (const path of ['/instances', '/endpoints']) {
    await b.page.goto(`${URL0}${path}`);
    const text = await b.page.locator('main').innerText();
    assert.ok(!text.includes(made.instance) && !text.includes('chat'), `${path} shows A's objects to B`);
  }
  for (const path of [`/instances/${made.instance}`, `/instances/${made.instance}/logs`,
                      `/endpoints/${made.endpoint}`, `/endpoints/${made.endpoint}/series`]) {
    const r = await b.page.goto(`${URL0}${path}`);
    assert.equal(r.status(), 404, `B opening ${path}`);
    assert.ok(!(await b.page.content()).includes('console-line'), `${path} leaks A's logs`);
  }
  // Nor through the terminal's WebSocket: the API's 404 comes back as the
  // session's error frame.
  await b.page.goto(`${URL0}/instances`);
  const refused = await b.page.evaluate(async (id) => {
    const csrf = document.querySelector('input[name="csrf"]').value;
    return await new Promise((resolve) => {
      const ws = new WebSocket(`ws://${location.host}/instances/${id}/terminal?csrf=${csrf}&cols=80&rows=24`);
      ws.binaryType = 'arraybuffer';
      ws.onmessage = (ev) => {
        const b = new Uint8Array(ev.data);
        resolve({ tag: b[0], text: new TextDecoder().decode(b.subarray(1)) });
      };
      ws.onclose = () => resolve({ closed: true });
    });
  }, made.instance);
  assert.equal(refused.tag, 6, `B's terminal into A's instance: ${JSON.stringify(refused)}`);
  assert.match(refused.text, /not found/);
  // B's pages have no operator entries, and the operator's pages are 404.
  assert.equal(await b.page.locator('nav a[href="/fleet"]').count(), 0);
  assert.equal((await b.page.goto(`${URL0}/fleet`)).status(), 404);
  await b.page.goto(`${URL0}/instances`);
  await shot(b.page, 'tenant-b-instances');
  // Signing out ends the session: the next page asks to sign in.
  await b.page.getByRole('button', { name: 'Sign out' }).click();
  await b.page.waitForURL(/\/login/);
  await b.page.goto(`${URL0}/instances`);
  assert.match(b.page.url(), /\/login/);
  await b.ctx.close();

  // --- Operator: fleet map, cordon a node.
  step('operator cordons a node');
  const op = await session(env('OP_KEY'));
  await op.page.goto(`${URL0}/fleet`);
  const node = op.page.locator(`li.node[data-name="${env('NODE_NAME')}"]`);
  await node.waitFor();
  assert.ok((await node.locator('li.gpu').count()) >= 1, 'GPU cells on the fleet map');
  await shot(op.page, 'fleet');
  await node.getByRole('button', { name: `Cordon ${env('NODE_NAME')}` }).click();
  await op.page.locator(`li.node.cordoned[data-name="${env('NODE_NAME')}"]`).waitFor();
  await shot(op.page, 'fleet-cordoned');
  made.cordoned = env('NODE_NAME');
  await op.page.goto(`${URL0}/queue`);
  await shot(op.page, 'queue');
  await op.page.goto(`${URL0}/tenants`);
  await op.page.locator('table', { hasText: 'acme' }).waitFor();
  await shot(op.page, 'tenants');
  await op.page.goto(`${URL0}/prices`);
  await shot(op.page, 'prices');
  await op.ctx.close();

  // --- A phone-sized screen: the instance list still reads.
  step('phone layout');
  const phone = await session(env('A_KEY'), { width: 390, height: 844 });
  await phone.page.goto(`${URL0}/instances`);
  await shot(phone.page, 'phone-instances');
  await phone.ctx.close();
  await a.ctx.close();

  console.log(JSON.stringify(made));
} finally {
  await browser.close();
}
