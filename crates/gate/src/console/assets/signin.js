// Sign-in, then the inventory and the output's lag: a pasted token is checked against a
// reader's route (it must read) and an operator's (whether it may also resolve) before it is
// kept for this tab.
'use strict';

(() => {
  const G = Gate;
  const STATUSES = ['blocked', 'waiting', 'flowing'];
  const PAGE = 100;
  const signIn = document.getElementById('sign-in');
  const inventory = document.getElementById('inventory');
  const problem = document.getElementById('sign-in-problem');

  const showSignInProblem = (message) => {
    problem.textContent = message;
    problem.hidden = !message;
  };

  /** The role `token` has at this gate, or the words of the refusal. */
  async function roleOf(token) {
    const reads = await G.send('GET', G.address(['v1', 'aggregates'], { status: 'blocked', limit: 1 }), { token });
    if (!reads.ok) return { refused: G.problemText(reads) };
    const administers = await G.send('GET', G.address(['v1', 'operators']), { token });
    return { role: administers.ok ? 'operator' : 'reader' };
  }

  async function submit(event) {
    event.preventDefault();
    const field = document.getElementById('token');
    const token = field.value.trim();
    if (!token) {
      showSignInProblem('Paste a token first.');
      return;
    }
    const checked = await roleOf(token);
    if (checked.refused) {
      showSignInProblem(`Not signed in: ${checked.refused}`);
      return;
    }
    field.value = '';
    G.session.start(token, checked.role);
    const back = G.session.takeReturn();
    if (back) window.location.assign(back);
    else window.location.reload();
  }

  /** The first page of the aggregates in `status`, and whether more follow. */
  async function listed(status) {
    const body = await G.read(G.address(['v1', 'aggregates'], { status, limit: PAGE }));
    return { rows: body.aggregates, more: body.next !== null };
  }

  async function load() {
    const lists = await Promise.all(STATUSES.map(listed));
    const rows = lists.flatMap((list) => list.rows);
    G.fillTable('aggregates', rows, [
      (a) => G.link('/console/aggregate', { id: a.aggregateId }, a.aggregateId),
      (a) => G.status(a.status),
      (a) => a.last,
      (a) => G.range(a.missing),
      (a) => (a.waitingSince ? G.duration(G.secondsSince(a.waitingSince) ?? a.ageSeconds) : null),
      (a) => G.duration(a.ageSeconds),
      (a) => a.openDeadLetters,
      (a) => a.held,
    ]);
    const cut = STATUSES.filter((_, index) => lists[index].more);
    document.getElementById('inventory-note').textContent = cut.length
      ? `Showing the first ${PAGE} of each status; more are ${cut.join(', ')}.`
      : `${rows.length} aggregate(s), read at ${new Date().toLocaleTimeString()}.`;
  }

  const CHART = { width: 600, height: 160, pad: 6 };
  const SERIES = [
    { name: 'applied', words: 'applied/s', value: (s) => s.appliedPerSecond, scale: 'rate' },
    { name: 'published', words: 'published/s', value: (s) => s.publishedPerSecond, scale: 'rate' },
    { name: 'backlog', words: 'backlog (rows)', value: (s) => s.backlog, scale: 'backlog' },
  ];

  /** A figure to at most two decimals, for the legend and the points' titles. */
  const figure = (value) => String(Math.round(value * 100) / 100);

  /**
   * The samples as inline SVG: each series a line with a point per sample (the rates on one
   * scale, the backlog on its own), drawn into the chart's `<svg>` behind its title.
   */
  function drawChart(samples) {
    const { width, height, pad } = CHART;
    const chart = document.getElementById('lag-chart');
    const top = {
      rate: Math.max(1, ...samples.flatMap((s) => [s.appliedPerSecond ?? 0, s.publishedPerSecond])),
      backlog: Math.max(1, ...samples.map((s) => s.backlog)),
    };
    const x = (index) => (samples.length === 1
      ? width / 2
      : pad + (index * (width - 2 * pad)) / (samples.length - 1));
    const y = (value, scale) => height - pad - (value / top[scale]) * (height - 2 * pad);
    const drawn = [G.svg('line', {
      class: 'grid-line', x1: 0, x2: width, y1: height - pad, y2: height - pad,
    })];
    for (const series of SERIES) {
      const points = samples
        .map((sample, index) => ({ sample, index, value: series.value(sample) }))
        .filter((point) => point.value !== null && point.value !== undefined);
      const at = points.map((point) => [x(point.index), y(point.value, series.scale)]);
      drawn.push(G.svg('polyline', {
        'data-series': series.name,
        points: at.map(([px, py]) => `${px.toFixed(1)},${py.toFixed(1)}`).join(' '),
      }));
      points.forEach((point, index) => {
        drawn.push(G.svg('circle', {
          'data-series': series.name, cx: at[index][0].toFixed(1), cy: at[index][1].toFixed(1), r: 3,
        }, G.svg('title', { text: `${G.time(point.sample.at)}: ${figure(point.value)} ${series.words}` })));
      });
    }
    const title = document.getElementById('lag-chart-title');
    chart.replaceChildren(title, ...drawn);
    chart.dataset.points = String(samples.length);
    document.getElementById('lag-legend').replaceChildren(
      ...SERIES.map((series) => G.el('span', {
        'data-series': series.name,
        text: `${series.words} (top: ${figure(top[series.scale])})`,
      })),
    );
  }

  /** The lag now, as facts, and the samples, as the chart. */
  async function loadLag() {
    const lag = await G.read(G.address(['v1', 'lag']));
    const latest = lag.samples[lag.samples.length - 1];
    const rows = lag.unpublishedRows >= 10000 ? '10000 or more' : String(lag.unpublishedRows);
    G.fillFacts('lag-facts', [
      ['unpublished rows', G.el('span', { id: 'lag-unpublished', text: rows })],
      ['oldest unpublished', lag.unpublishedRows > 0 ? G.duration(lag.oldestUnpublishedSeconds) : 'none waits'],
      ['publisher', `${lag.publisher.role}${lag.publisher.epoch ? ` (epoch ${lag.publisher.epoch})` : ''}`],
      ['applied/s', latest && latest.appliedPerSecond !== null ? figure(latest.appliedPerSecond) : null],
      ['published/s', latest ? figure(latest.publishedPerSecond) : null],
    ]);
    drawChart(lag.samples);
    document.getElementById('lag-note').textContent = lag.samples.length
      ? `${lag.samples.length} sample(s), one every ${lag.sampleEverySeconds} s; read at ${new Date().toLocaleTimeString()}.`
      : `No sample yet: the gate takes one every ${lag.sampleEverySeconds} s.`;
    return lag.sampleEverySeconds;
  }

  /** The lag, read again at each of the gate's samples while the page is open. */
  async function followLag() {
    const lagNote = document.getElementById('lag-note');
    const every = await loadLag().catch((error) => {
      lagNote.textContent = `The lag could not be read: ${error.message}`;
      return 5;
    });
    window.setInterval(() => {
      loadLag().catch((error) => {
        lagNote.textContent = `The lag could not be read: ${error.message}`;
      });
    }, Math.max(1, every) * 1000);
  }

  G.page(() => {
    const notice = G.session.takeNotice();
    if (!G.session.token()) {
      signIn.hidden = false;
      showSignInProblem(notice);
      document.getElementById('sign-in-form').addEventListener('submit', (event) => {
        submit(event).catch((error) => showSignInProblem(`Could not check the token: ${error.message}`));
      });
      return undefined;
    }
    inventory.hidden = false;
    document.getElementById('lag').hidden = false;
    document.getElementById('refresh').addEventListener('click', () => {
      load().catch((error) => G.showProblem(error.message));
      loadLag().catch((error) => {
        document.getElementById('lag-note').textContent = `The lag could not be read: ${error.message}`;
      });
    });
    followLag();
    return load();
  }, { signInHere: true });
})();
