// A dead letter and its resolution: the record, its aggregate now, a form for replace or skip
// with a dry-run preview, and the audit trail. Every refusal is explained in words.
'use strict';

(() => {
  const C = LabConsole;
  const { paragraph } = C;
  const id = C.param('id');
  // A producer's dead letter is addressed with its producer (absent: an anonymous delivery's).
  const producer = C.param('producer');
  // The id goes into the query, never the path: a message id may be `.` or `..`, which a browser
  // drops from a path (even as `%2E`), so a path would read or resolve something else.
  const named = { messageId: id, producer };
  const problem = document.getElementById('dl-error');
  const form = document.getElementById('resolve-form');
  const expectedLast = document.getElementById('expected-last');
  const replacementFields = document.getElementById('replacement-fields');
  const moved = document.getElementById('dl-moved');
  document.getElementById('dl-id').textContent = id;
  document.title = `Dead letter ${id} · production-lab console`;

  let aggregateId = null;
  // The form is filled from the first read only: what the operator saw is what they state.
  let prefilled = false;
  let sending = false;

  const show = (message) => {
    problem.textContent = message;
    problem.hidden = !message;
  };

  async function load() {
    const answer = await C.get(C.address(['console', 'api', 'deadletter'], named));
    if (!answer.ok) {
      show(C.problemText(answer));
      return;
    }
    show('');
    const d = answer.body;
    aggregateId = d.aggregateId;
    const resolution = d.resolution
      ? `#${d.resolution.resolutionId} ${d.resolution.action} by ${d.resolution.operator}: ${d.resolution.reason}`
      : null;
    C.fillFacts('dl-details', [
      ['message id', d.messageId],
      ...(d.producer ? [['producer', d.producer]] : []),
      ['aggregate', d.aggregateId ? C.link('/console/aggregate', { id: d.aggregateId }, d.aggregateId) : null],
      ['sequence', d.sequence],
      ['status', C.el('span', { text: d.status, 'data-tone': C.tone(d.status) })],
      ['reason', d.reason],
      ['observations', d.observations],
      ['first seen', C.time(d.firstSeen)],
      ['last seen', C.time(d.lastSeen)],
      ['superseded by', d.supersededBy],
      ['closed at', C.time(d.closedAt)],
      ['resolution', resolution],
    ]);
    document.getElementById('dl-payload').textContent =
      d.payload === null ? '(not recorded)' : JSON.stringify(d.payload, null, 2);

    if (!aggregateId) return;
    const [view, audit] = await Promise.all([
      C.get(C.address(['aggregates', aggregateId])),
      C.getOk(C.address(['resolutions'], { aggregateId, limit: 100 })),
    ]);
    if (view.ok) {
      const a = view.body;
      C.fillFacts('dl-aggregate', [
        ['status', C.el('span', { text: a.status, 'data-tone': C.tone(a.status) })],
        ['last', a.last],
        ['expected next', a.expected],
        ['total', a.total],
        ['open dead letters', a.openDeadLetterCount],
      ]);
      if (!prefilled) {
        expectedLast.value = String(a.last);
        prefilled = true;
      }
      const stated = expectedLast.value;
      moved.hidden = stated === String(a.last);
      moved.textContent = `The aggregate's last sequence is now ${a.last}; the form says expectedLast ${stated}.`;
    }
    C.fillTable('audit', audit.resolutions, [
      (r) => r.resolutionId,
      (r) => r.messageId,
      (r) => (r.replacement ? `replace with ${r.replacement.messageId} (amount ${r.replacement.amount})` : r.action),
      (r) => r.operator,
      (r) => r.reason,
      (r) => `${r.before.last} → ${r.after.last}`,
      (r) => C.time(r.resolvedAt),
    ], { rowClass: (r) => (r.messageId === id ? 'fresh' : undefined) });
  }

  function chosenAction() {
    const checked = form.querySelector('input[name="action"]:checked');
    return checked ? checked.value : 'replace';
  }

  function syncAction() {
    replacementFields.hidden = chosenAction() !== 'replace';
  }

  /** The request body from the form, or a sentence saying what is missing. */
  function readForm() {
    const action = chosenAction();
    const last = expectedLast.valueAsNumber;
    if (!Number.isFinite(last)) return { missing: 'expectedLast: enter the last sequence you saw.' };
    const body = { action, expectedLast: last, reason: document.getElementById('reason').value };
    if (action === 'replace') {
      const amount = document.getElementById('replacement-amount').valueAsNumber;
      if (!Number.isFinite(amount)) return { missing: 'Replacement amount: enter a whole number.' };
      body.replacement = { messageId: document.getElementById('replacement-id').value, amount };
    }
    return { body };
  }

  function describeRecord(r) {
    const what = r.replacement
      ? `replace ${r.messageId} with ${r.replacement.messageId} (amount ${r.replacement.amount})`
      : `skip ${r.messageId} (sequence ${r.sequence} taken with no effect)`;
    return [
      paragraph(`${what} on ${r.aggregateId}, by ${r.operator}: "${r.reason}"`),
      paragraph(`last ${r.before.last} → ${r.after.last}, total ${r.before.total} → ${r.after.total}`, { class: 'move' }),
    ];
  }

  /** The answer in words: what happened, or why nothing did. */
  function explain(answer, sent) {
    const body = answer.body || {};
    const title = body.title || '';
    const detail = body.detail || '';
    if (answer.ok && body.outcome === 'dry run') {
      return ['preview', [paragraph('Preview (dry run): nothing was written. Resolving would do this:', { class: 'headline' }), ...describeRecord(body)]];
    }
    if (answer.ok) {
      return ['resolved', [paragraph(`Resolved: resolution #${body.resolutionId}, recorded at ${C.time(body.resolvedAt)}.`, { class: 'headline' }), ...describeRecord(body)]];
    }
    const lines = [];
    if (answer.status === 401) {
      lines.push(paragraph(`401 — not authorized, nothing was changed: ${title}.`, { class: 'headline' }));
      lines.push(paragraph(detail));
      lines.push(paragraph('Paste the token that `production-lab operator add NAME --database PATH` printed for an active operator.'));
    } else if (answer.status === 409) {
      lines.push(paragraph(`409 — refused, nothing was changed: ${title}.`, { class: 'headline' }));
      lines.push(paragraph(detail));
      const current = body.current || {};
      const a = current.aggregate;
      const d = current.deadLetter;
      const now = [];
      if (a) {
        const yours = sent && a.last !== sent.expectedLast
          ? ` (you sent expectedLast ${sent.expectedLast}: someone moved it since you looked)`
          : ` (you sent expectedLast ${sent ? sent.expectedLast : '—'})`;
        now.push(`the aggregate's last sequence is ${a.last}${yours}, status ${a.status}`);
      }
      if (d) {
        const by = d.resolution
          ? `, resolved by ${d.resolution.operator} (${d.resolution.action}, resolution #${d.resolution.resolutionId})`
          : d.supersededBy ? `, superseded by ${d.supersededBy}` : '';
        now.push(`this dead letter is ${d.status}${by}`);
      }
      if (now.length > 0) lines.push(paragraph(`Now: ${now.join('; ')}.`, { class: 'current' }));
      lines.push(paragraph('Review the current state above and decide again.'));
    } else if (answer.status === 400) {
      lines.push(paragraph(`400 — the request was refused, nothing was changed: ${detail || title}`, { class: 'headline' }));
    } else {
      lines.push(paragraph(`${answer.status} — ${title || 'refused'}, nothing was changed.`, { class: 'headline' }));
      if (detail) lines.push(paragraph(detail));
    }
    return [String(answer.status), lines];
  }

  function render(state, kind, lines) {
    C.result('resolve-result', state, kind, lines);
  }

  async function submit(dryRun) {
    if (sending) return;
    const input = readForm();
    if (input.missing) {
      render('incomplete', 'refusal', [paragraph(`Not sent: ${input.missing}`)]);
      return;
    }
    sending = true;
    render('sending', 'preview', [paragraph(dryRun ? 'Previewing…' : 'Resolving…')]);
    // Read at the moment of sending and passed on directly: the token lives in the input only.
    const token = document.getElementById('token').value.trim();
    const path = C.address(['deadletters', 'resolution'], { ...named, dryRun: dryRun ? 'true' : undefined });
    try {
      const answer = await C.request('POST', path, { body: input.body, token });
      const [state, lines] = explain(answer, input.body);
      render(state, state === 'preview' ? 'preview' : state === 'resolved' ? 'success' : 'refusal', lines);
      if (answer.ok && !dryRun) refresh();
    } catch (error) {
      render('error', 'refusal', [paragraph(`The request could not be sent: ${error.message}`)]);
    } finally {
      sending = false;
    }
  }

  const refresh = C.refresher(load, (error) => show(`Could not read the dead letter: ${error.message}`));
  form.addEventListener('change', syncAction);
  form.addEventListener('submit', (event) => event.preventDefault());
  document.getElementById('preview').addEventListener('click', () => submit(true));
  document.getElementById('resolve').addEventListener('click', () => submit(false));
  syncAction();

  if (!id) {
    show('No dead letter named: open this page as /console/deadletter?id=MESSAGE_ID.');
    return;
  }
  C.live({
    onReset: refresh,
    onChange: (change) => {
      if (change.messageId === id || change.aggregateId === aggregateId) refresh();
    },
  });
  refresh();
})();
