// A dead letter and, for an operator, its resolution: skip, or replace with a corrected message
// of a type and a JSON payload. A dry run comes first; the resolution sends exactly the values
// previewed. Every refusal is explained in words.
'use strict';

(() => {
  const G = Gate;
  const messageId = G.param('messageId');
  // A producer's dead letter is named with its producer (absent: an anonymous delivery's).
  const producer = G.param('producer');
  // The id goes into the query, never the path: a message id may be `.` or `..`, which a browser
  // drops from a path.
  const named = { messageId, producer };
  const form = document.getElementById('resolve-form');
  const expectedLast = document.getElementById('expected-last');
  const resolveButton = document.getElementById('resolve-button');
  let prefilled = false;
  // The body of the last dry run that answered 200: the resolution sends exactly it.
  let previewed = null;

  document.getElementById('dl-id').textContent = messageId;
  document.title = `Dead letter ${messageId} · gate console`;

  function showRecord(d) {
    const resolution = d.resolution
      ? `#${d.resolution.resolutionId} ${d.resolution.action} by ${d.resolution.operator}: ${d.resolution.reason}`
      : null;
    G.fillFacts('dl-details', [
      ['message id', d.messageId],
      ['producer', d.producer || 'anonymous'],
      ['aggregate', d.aggregateId ? G.link('/console/aggregate', { id: d.aggregateId }, d.aggregateId) : null],
      ['sequence', d.sequence],
      ['status', G.status(d.status)],
      ['observations', d.observations],
      ['first seen', G.time(d.firstSeen)],
      ['last seen', G.time(d.lastSeen)],
      ['superseded by', d.supersededBy],
      ['closed at', G.time(d.closedAt)],
      ['resolution', resolution],
    ]);
    document.getElementById('dl-reason').textContent = d.reason;
    document.getElementById('dl-payload').textContent =
      d.payload === null ? '(not recorded)' : JSON.stringify(d.payload, null, 2);
  }

  function showAggregate(a) {
    G.fillFacts('dl-aggregate', [
      ['status', G.status(a.status)],
      ['last', a.last],
      ['expected next', a.expected],
      ['open dead letters', a.openDeadLetterCount],
      ['held', a.heldCount],
    ]);
    const moved = document.getElementById('dl-moved');
    const stated = expectedLast.value;
    moved.hidden = !prefilled || stated === String(a.last);
    moved.textContent = `The aggregate's last sequence is now ${a.last}; the form says expectedLast ${stated}.`;
  }

  /** The form starts from the dead letter as it was sent and the aggregate as it is. */
  function prefill(d, a) {
    const envelope = d.payload && typeof d.payload === 'object' ? d.payload : {};
    document.getElementById('replacement-type').value = typeof envelope.type === 'string' ? envelope.type : '';
    document.getElementById('replacement-payload').value =
      envelope.payload === undefined ? '{}' : JSON.stringify(envelope.payload, null, 2);
    expectedLast.value = String(a.last);
    prefilled = true;
  }

  async function load() {
    const d = await G.read(G.address(['v1', 'deadletter'], named));
    showRecord(d);
    const operator = G.session.isOperator();
    document.getElementById('resolve').hidden = !operator || d.status !== 'open';
    document.getElementById('resolve-reader').hidden = operator;
    if (!d.aggregateId) return;
    const a = await G.read(G.address(['v1', 'aggregates', d.aggregateId]));
    if (!prefilled && operator) prefill(d, a);
    showAggregate(a);
  }

  function chosenAction() {
    const checked = form.querySelector('input[name="action"]:checked');
    return checked ? checked.value : 'replace';
  }

  /** The request body from the form, or a sentence saying what is missing or wrong. */
  function readForm() {
    const action = chosenAction();
    const last = expectedLast.valueAsNumber;
    if (!Number.isFinite(last)) return { missing: 'expectedLast: enter the last sequence you saw.' };
    const body = { action, expectedLast: last, reason: document.getElementById('reason').value };
    if (action !== 'replace') return { body };
    let payload;
    try {
      payload = JSON.parse(document.getElementById('replacement-payload').value);
    } catch (error) {
      return { missing: `the replacement payload is not JSON (${error.message}).` };
    }
    const replacement = { type: document.getElementById('replacement-type').value.trim(), payload };
    const newId = document.getElementById('replacement-id').value.trim();
    if (newId) replacement.messageId = newId;
    body.replacement = replacement;
    return { body };
  }

  function describeRecord(r) {
    const what = r.replacement
      ? `replace ${r.messageId} with ${r.replacement.messageId}: ${JSON.stringify(r.replacement.payload)}`
      : `skip ${r.messageId} (sequence ${r.sequence} taken with no effect)`;
    return [
      G.paragraph(`${what} on ${r.aggregateId}, by ${r.operator}: "${r.reason}"`),
      G.paragraph(`last ${r.before.last} → ${r.after.last}`, { class: 'move' }),
    ];
  }

  /** A 409's words: what failed, and the aggregate and the dead letter as they are now. */
  function conflict(answer, sent) {
    const lines = G.refusal(answer);
    const current = (answer.body || {}).current || {};
    const now = [];
    if (current.aggregate) {
      now.push(`the aggregate's last sequence is ${current.aggregate.last} (you sent expectedLast ${sent.expectedLast}), status ${current.aggregate.status}`);
    }
    if (current.deadLetter) now.push(`this dead letter is ${current.deadLetter.status}`);
    if (now.length) lines.push(G.paragraph(`Now: ${now.join('; ')}.`, { class: 'current' }));
    lines.push(G.paragraph('Review the current state above and decide again.'));
    return lines;
  }

  function refused(answer, sent) {
    previewed = null;
    resolveButton.disabled = true;
    const lines = answer.status === 409 ? conflict(answer, sent) : G.refusal(answer);
    G.result('resolve-result', String(answer.status), 'refusal', lines);
  }

  async function submit(dryRun) {
    const input = readForm();
    if (input.missing) {
      G.result('resolve-result', 'incomplete', 'refusal', [G.paragraph(`Not sent: ${input.missing}`)]);
      return;
    }
    const body = dryRun ? input.body : previewed;
    const path = G.address(['v1', 'deadletters', 'resolution'], { ...named, dryRun: dryRun ? 'true' : undefined });
    G.result('resolve-result', 'sending', 'preview', [G.paragraph(dryRun ? 'Previewing…' : 'Resolving…')]);
    const answer = await G.call('POST', path, body);
    if (!answer.ok) {
      refused(answer, body);
      return;
    }
    if (dryRun) {
      previewed = input.body;
      resolveButton.disabled = false;
      G.result('resolve-result', 'preview', 'preview', [
        G.paragraph('Preview (dry run): nothing was written. Resolving would do this:', { class: 'headline' }),
        ...describeRecord(answer.body),
      ]);
      return;
    }
    previewed = null;
    resolveButton.disabled = true;
    G.result('resolve-result', 'resolved', 'success', [
      G.paragraph(`Resolved: resolution #${answer.body.resolutionId}, recorded at ${G.time(answer.body.resolvedAt)}.`, { class: 'headline' }),
      ...describeRecord(answer.body),
    ]);
    await load();
    // The form is hidden once the dead letter is no longer open; its answer stays in view.
    document.getElementById('resolve').hidden = false;
    form.hidden = true;
  }

  const failed = (error) => {
    if (error.message !== 'signed out') G.showProblem(error.message);
  };

  G.page(() => {
    if (!messageId) {
      G.showProblem('No dead letter named: open this page as /console/deadletter?messageId=MESSAGE_ID&producer=PRODUCER.');
      return undefined;
    }
    const sync = () => {
      document.getElementById('replacement-fields').hidden = chosenAction() !== 'replace';
    };
    // Any edit after a preview asks for a new one: the resolution sends only what was previewed.
    form.addEventListener('input', () => {
      previewed = null;
      resolveButton.disabled = true;
      sync();
    });
    form.addEventListener('submit', (event) => event.preventDefault());
    document.getElementById('preview').addEventListener('click', () => submit(true).catch(failed));
    resolveButton.addEventListener('click', () => submit(false).catch(failed));
    sync();
    return load();
  });
})();
