// The lesson, step by step: each run sends the lesson's messages to a fresh aggregate through the
// general door and reads the rows back after every step.
'use strict';

(() => {
  const C = LabConsole;

  const STEPS = [
    { key: 'm-2', sequence: 2, amount: 1, what: 'Sequence 2 arrives first' },
    { key: 'm-1', sequence: 1, amount: 1, what: 'Sequence 1' },
    { key: 'poison-2', sequence: 2, amount: -1, what: 'A poison 2: a negative amount' },
    { key: 'm-1', sequence: 1, amount: 1, what: 'Message 1 again, unchanged: the replay' },
    { key: 'm-1', sequence: 1, amount: 5, what: "Message 1's id with a changed amount" },
    { key: 'late-1', sequence: 1, amount: 1, what: 'A new id for sequence 1, which is taken: stale' },
    { key: 'corrected-2', sequence: 2, amount: 1, what: 'The corrected 2, under a new id' },
  ];

  const stepsList = document.getElementById('steps');
  const verdict = document.getElementById('verdict');
  const verdictAction = document.getElementById('verdict-action');
  const changeLine = document.getElementById('change-line');
  const runLink = document.getElementById('run-aggregate');

  let run = null;
  let busy = false;

  const emptySnapshot = () => ({ applied: [], state: null, deadLetters: [] });
  const messageId = (step) => `${run.aggregate}:${step.key}`;

  function newRun() {
    const stamp = Date.now().toString(36);
    const salt = Math.floor(Math.random() * 36 ** 4).toString(36);
    run = { aggregate: `lesson-${stamp}-${salt}`, done: 0, snapshot: emptySnapshot() };
    runLink.textContent = run.aggregate;
    runLink.href = C.pageUrl('/console/aggregate', { id: run.aggregate });
    verdict.textContent = 'Run the first step.';
    verdict.dataset.state = 'none';
    verdict.removeAttribute('data-tone');
    verdictAction.textContent = '';
    changeLine.textContent = '';
    renderSteps();
    renderRows(run.snapshot, new Set());
  }

  function renderSteps() {
    const items = STEPS.map((step, index) => {
      const body = { messageId: messageId(step), sequence: step.sequence, amount: step.amount };
      const button = C.el('button', {
        type: 'button',
        text: 'Run',
        disabled: busy || index !== run.done,
        'aria-label': `Run step ${index + 1}`,
      });
      button.addEventListener('click', () => runStep(index));
      const item = C.el(
        'li',
        { 'data-step': index + 1 },
        button,
        C.el('span', { class: 'what' }, `${index + 1}. ${step.what}`,
          C.el('span', { class: 'body', text: JSON.stringify(body) })),
        C.el('span', { class: 'result' }),
      );
      const result = run.results && run.results[index];
      if (result) {
        item.dataset.outcome = result.outcome;
        const cell = item.querySelector('.result');
        cell.textContent = `${result.status} ${result.outcome}`;
        cell.dataset.tone = C.tone(result.outcome);
      }
      return item;
    });
    stepsList.replaceChildren(...items);
  }

  async function readRows(aggregate) {
    const [messages, state, deadLetters] = await Promise.all([
      C.getOk(C.address(['console', 'api', 'aggregates', aggregate, 'messages'], { limit: 100 })),
      C.get(C.address(['aggregates', aggregate])),
      C.getOk(C.address(['deadletters'], { aggregateId: aggregate, limit: 100 })),
    ]);
    if (!state.ok && state.status !== 404) throw new Error(C.problemText(state));
    return {
      applied: messages.messages,
      state: state.ok ? state.body : null,
      deadLetters: deadLetters.deadLetters,
    };
  }

  function renderRows(rows, fresh) {
    const mark = (key) => (fresh.has(key) ? 'fresh' : undefined);
    C.fillTable('applied', rows.applied, [
      (m) => m.messageId, (m) => m.sequence, (m) => m.amount, (m) => C.time(m.appliedAt),
    ], { rowClass: (m) => mark(`applied:${m.messageId}`) });
    C.fillTable('state', rows.state ? [rows.state] : [], [
      (s) => s.last, (s) => s.total, (s) => s.expected, (s) => s.status, (s) => C.time(s.since),
    ], { rowClass: () => mark('state') });
    C.fillTable('deadletters', rows.deadLetters, [
      (d) => C.link('/console/deadletter', { id: d.messageId }, d.messageId),
      (d) => d.sequence, (d) => d.status, (d) => d.observations, (d) => d.reason,
      (d) => d.supersededBy,
    ], { rowClass: (d) => mark(`dead:${d.messageId}`) });
  }

  /** What the step changed in the three tables, and what it left alone, in one line. */
  function describe(before, after) {
    const changed = [];
    const unchanged = [];
    const fresh = new Set();

    const known = new Set(before.applied.map((m) => m.messageId));
    const added = after.applied.filter((m) => !known.has(m.messageId));
    if (added.length > 0) {
      changed.push(`ordered_inbox +${added.length} row (${added.map((m) => m.messageId).join(', ')})`);
      added.forEach((m) => fresh.add(`applied:${m.messageId}`));
    } else {
      unchanged.push('ordered_inbox');
    }

    const [was, now] = [before.state, after.state];
    if (!was && !now) {
      unchanged.push('aggregate_state (no row)');
    } else if (!was) {
      changed.push(`aggregate_state row written: last ${now.last}, status ${now.status}`);
      fresh.add('state');
    } else {
      const moves = ['last', 'total', 'status']
        .filter((field) => was[field] !== now[field])
        .map((field) => `${field} ${was[field]} → ${now[field]}`);
      if (moves.length > 0) {
        changed.push(`aggregate_state ${moves.join(', ')}`);
        fresh.add('state');
      } else {
        unchanged.push('aggregate_state');
      }
    }

    const earlier = new Map(before.deadLetters.map((d) => [d.messageId, d]));
    const letters = [];
    for (const d of after.deadLetters) {
      const old = earlier.get(d.messageId);
      if (!old) {
        letters.push(`+1 row (${d.messageId}, ${d.status})`);
      } else {
        if (old.status !== d.status) letters.push(`${d.messageId} ${old.status} → ${d.status}`);
        if (old.observations !== d.observations) {
          letters.push(`${d.messageId} observations ${old.observations} → ${d.observations}`);
        }
      }
      if (!old || old.status !== d.status || old.observations !== d.observations) {
        fresh.add(`dead:${d.messageId}`);
      }
    }
    if (letters.length > 0) changed.push(`deadletters ${letters.join(', ')}`);
    else unchanged.push('deadletters');

    const head = changed.length > 0 ? `Changed: ${changed.join('; ')}.` : 'Nothing changed.';
    const tail = unchanged.length > 0 ? ` Unchanged: ${unchanged.join(', ')}.` : '';
    return { line: head + tail, fresh };
  }

  /** The verdict in words: status, outcome and the numbers that matter. */
  function verdictWords(answer) {
    const body = answer.body || {};
    const outcome = body.outcome || body.title || 'no answer';
    const facts = [];
    if (body.last !== undefined) facts.push(`last ${body.last}`);
    if (body.total !== undefined) facts.push(`total ${body.total}`);
    if (body.expected !== undefined) facts.push(`expected ${body.expected}`);
    if (body.reason !== undefined) facts.push(`reason ${body.reason}`);
    if (body.original) facts.push(`originally applied as sequence ${body.original.sequence}`);
    if (body.superseded && body.superseded.length > 0) {
      facts.push(`superseded ${body.superseded.join(', ')}`);
    }
    const action = body.action || (body.resolution && body.resolution.how) || body.detail || '';
    return { outcome, text: `${answer.status} ${outcome}${facts.length ? ` · ${facts.join(' · ')}` : ''}`, action };
  }

  async function runStep(index) {
    if (busy || index !== run.done) return;
    busy = true;
    renderSteps();
    const current = run;
    const step = STEPS[index];
    const body = { messageId: messageId(step), sequence: step.sequence, amount: step.amount };
    try {
      const answer = await C.request(
        'POST', C.address(['aggregates', current.aggregate, 'messages']), { body },
      );
      const rows = await readRows(current.aggregate);
      const words = verdictWords(answer);
      const change = describe(current.snapshot, rows);
      current.snapshot = rows;
      current.done = index + 1;
      current.results = current.results || [];
      current.results[index] = { status: answer.status, outcome: words.outcome };
      if (run !== current) return;
      verdict.textContent = `Step ${index + 1}: ${words.text}`;
      verdict.dataset.state = words.outcome;
      verdict.dataset.tone = C.tone(words.outcome);
      verdictAction.textContent = words.action;
      changeLine.textContent = change.line;
      renderRows(rows, change.fresh);
    } catch (error) {
      verdict.textContent = `Step ${index + 1} failed: ${error.message}`;
      verdict.dataset.state = 'error';
      verdict.dataset.tone = 'bad';
    } finally {
      busy = false;
      if (run === current) renderSteps();
    }
  }

  document.getElementById('new-run').addEventListener('click', () => {
    if (!busy) newRun();
  });

  const refresh = C.refresher(async () => {
    if (run.done > 0 && !busy) renderRows(await readRows(run.aggregate), new Set());
  }, () => {});
  C.live({
    onReset: refresh,
    onChange: (change) => {
      if (change.aggregateId === run.aggregate) refresh();
    },
  });

  newRun();
})();
