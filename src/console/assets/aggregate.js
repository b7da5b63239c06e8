// One aggregate: its state, its open and closed dead letters, its timeline (paged) and its
// resolutions, following changes as they commit.
'use strict';

(() => {
  const C = LabConsole;
  const { paragraph } = C;
  const PAGE = 20;
  const id = C.param('id');
  const problem = document.getElementById('aggregate-error');
  document.getElementById('aggregate-id').textContent = id;
  document.title = `${id} · production-lab console`;

  // The timeline's pages: each entry is the `after` cursor that starts a page.
  let pages = [0];
  let next = null;

  const show = (message) => {
    problem.textContent = message;
    problem.hidden = !message;
  };

  async function load() {
    const after = pages[pages.length - 1];
    const [view, resolved, superseded, timeline, audit] = await Promise.all([
      C.get(C.address(['aggregates', id])),
      C.getOk(C.address(['deadletters'], { aggregateId: id, status: 'resolved', limit: 100 })),
      C.getOk(C.address(['deadletters'], { aggregateId: id, status: 'superseded', limit: 100 })),
      C.getOk(C.address(['aggregates', id, 'timeline'], { after, limit: PAGE })),
      C.getOk(C.address(['resolutions'], { aggregateId: id, limit: 100 })),
    ]);
    if (view.ok) {
      show('');
      const a = view.body;
      C.fillFacts('summary', [
        ['status', C.el('span', { text: a.status, 'data-tone': C.tone(a.status) })],
        ['last', a.last],
        ['expected next', a.expected],
        ['total', a.total],
        ['since', C.time(a.since)],
        ['open dead letters', a.openDeadLetterCount],
        // Broker deliveries ahead of their turn, waiting for a predecessor.
        ['held', a.heldCount ? `${a.heldCount}: ${a.heldSequences.join(', ')}` : '0'],
        // A waiting aggregate's missing sequences, and how long it has waited for them.
        ['missing', a.missing ? rangeText(a.missing) : null],
        ['waiting since', a.missing ? C.time(a.waitingSince) : null],
      ]);
      showGap(a);
      C.fillTable('open-deadletters', a.openDeadLetters, [
        (d) => C.link('/console/deadletter', C.deadLetterParams(d), d.messageId),
        (d) => d.sequence, (d) => d.reason, (d) => d.observations, (d) => C.time(d.firstSeen),
      ]);
    } else {
      show(C.problemText(view));
      C.fillFacts('summary', []);
      C.fillTable('open-deadletters', [], []);
    }
    const closed = resolved.deadLetters.concat(superseded.deadLetters);
    C.fillTable('closed-deadletters', closed, [
      (d) => C.link('/console/deadletter', C.deadLetterParams(d), d.messageId),
      (d) => d.sequence,
      (d) => d.status,
      (d) => (d.resolution ? `${d.resolution.action} by ${d.resolution.operator}` : d.supersededBy),
      (d) => C.time(d.closedAt),
    ]);
    next = timeline.next;
    C.fillTable('timeline', timeline.events, [
      (e) => e.id,
      (e) => C.time(e.at),
      (e) => (e.observation ? `${e.kind} (observation)` : e.kind),
      (e) => e.sequence,
      (e) => e.messageId,
      (e) => (e.detail ? Object.entries(e.detail).map(([k, v]) => `${k} ${C.display(v)}`).join(', ') : ''),
    ]);
    document.getElementById('timeline-page').textContent =
      `page ${pages.length}${next === null ? ', the last' : ''}`;
    document.getElementById('timeline-first').disabled = pages.length === 1;
    document.getElementById('timeline-previous').disabled = pages.length === 1;
    document.getElementById('timeline-next').disabled = next === null;
    C.fillTable('audit', audit.resolutions, [
      (r) => r.resolutionId,
      (r) => (r.messageId ? C.link('/console/deadletter', C.deadLetterParams(r), r.messageId) : '—'),
      (r) => (r.messageId === undefined && r.from !== undefined ? `skip gap ${rangeText(r)}` : r.replacement ? `replace with ${r.replacement.messageId} (amount ${r.replacement.amount})` : r.action),
      (r) => r.operator,
      (r) => r.reason,
      (r) => `${r.before.last} → ${r.after.last}`,
      (r) => C.time(r.resolvedAt),
    ]);
  }

  // The gap panel: shown while the aggregate waits for a missing range, filled from the first
  // read of each range only, so what the operator saw is what they state.
  const gapPanel = document.getElementById('gap-panel');
  const gapFrom = document.getElementById('gap-from');
  const gapThrough = document.getElementById('gap-through');
  const gapExpectedLast = document.getElementById('gap-expected-last');
  const gapResult = document.getElementById('gap-result');
  let gapShown = null;
  let gapSending = false;

  function rangeText(range) {
    return range.from === range.through ? `${range.from}` : `${range.from}–${range.through}`;
  }

  function showGap(a) {
    if (!a.missing) {
      gapPanel.hidden = gapResult.dataset.state === 'none';
      gapShown = null;
      return;
    }
    gapPanel.hidden = false;
    document.getElementById('gap-range').textContent = rangeText(a.missing);
    const since = Date.parse(a.waitingSince);
    document.getElementById('gap-age').textContent = Number.isFinite(since)
      ? C.duration(Math.max(0, (Date.now() - since) / 1000))
      : 'a while';
    const key = `${a.last}:${a.missing.from}:${a.missing.through}`;
    if (gapShown === key) return;
    gapShown = key;
    gapFrom.value = String(a.missing.from);
    gapThrough.value = String(a.missing.through);
    gapExpectedLast.value = String(a.last);
  }

  /** The request body from the gap form, or a sentence saying what is missing. */
  function readGapForm() {
    const from = gapFrom.valueAsNumber;
    const through = gapThrough.valueAsNumber;
    const last = gapExpectedLast.valueAsNumber;
    if (!Number.isFinite(through)) return { missing: 'through: enter the last sequence to skip.' };
    if (!Number.isFinite(last)) return { missing: 'expectedLast: enter the last sequence you saw.' };
    const reason = document.getElementById('gap-reason').value;
    return { body: { action: 'skip', from, through, expectedLast: last, reason } };
  }

  /** The gap resolution's answer in words: what happened, or why nothing did. */
  function explainGap(answer, sent) {
    const body = answer.body || {};
    const drained = (body.drained || []).map((d) => (typeof d === 'object' ? d.sequence : d));
    const move = body.before && body.after
      ? paragraph(`last ${body.before.last} → ${body.after.last}${drained.length ? `, then applied ${drained.join(', ')}` : ''}`, { class: 'move' })
      : paragraph('');
    if (answer.ok && body.outcome === 'dry run') {
      return ['preview', [paragraph(`Preview (dry run): nothing was written. Skipping ${rangeText(sent)} would do this:`, { class: 'headline' }), move]];
    }
    if (answer.ok) {
      return ['resolved', [paragraph(`Resolved: resolution #${body.resolutionId}, ${rangeText(sent)} skipped.`, { class: 'headline' }), move]];
    }
    const title = body.title || 'refused';
    const lines = [paragraph(`${answer.status} — ${title}, nothing was changed.`, { class: 'headline' })];
    if (body.detail) lines.push(paragraph(body.detail));
    // A gap's refusal carries the aggregate's view itself as `current`.
    const current = body.current ? body.current.aggregate || body.current : null;
    if (answer.status === 409 && current) {
      lines.push(paragraph(`Now: the aggregate's last sequence is ${current.last} (you sent expectedLast ${sent.expectedLast}), status ${current.status}.`, { class: 'current' }));
    }
    if (answer.status === 401) {
      lines.push(paragraph('Paste the token that `production-lab operator add NAME --database PATH` printed for an active operator.'));
    }
    return [String(answer.status), lines];
  }

  function renderGap(state, kind, lines) {
    C.result('gap-result', state, kind, lines);
  }

  async function submitGap(dryRun) {
    if (gapSending) return;
    const input = readGapForm();
    if (input.missing) {
      renderGap('incomplete', 'refusal', [paragraph(`Not sent: ${input.missing}`)]);
      return;
    }
    gapSending = true;
    renderGap('sending', 'preview', [paragraph(dryRun ? 'Previewing…' : 'Resolving…')]);
    // Read at the moment of sending and passed on directly: the token lives in the input only.
    const token = document.getElementById('gap-token').value.trim();
    const path = C.address(['aggregates', id, 'gaps', 'resolution'], { dryRun: dryRun ? 'true' : undefined });
    try {
      const answer = await C.request('POST', path, { body: input.body, token });
      const [state, lines] = explainGap(answer, input.body);
      renderGap(state, state === 'preview' ? 'preview' : state === 'resolved' ? 'success' : 'refusal', lines);
      if (answer.ok && !dryRun) refresh();
    } catch (error) {
      renderGap('error', 'refusal', [paragraph(`The request could not be sent: ${error.message}`)]);
    } finally {
      gapSending = false;
    }
  }

  document.getElementById('gap-form').addEventListener('submit', (event) => event.preventDefault());
  document.getElementById('gap-preview').addEventListener('click', () => submitGap(true));
  document.getElementById('gap-resolve').addEventListener('click', () => submitGap(false));

  const refresh = C.refresher(load, (error) => show(`Could not read the aggregate: ${error.message}`));
  document.getElementById('timeline-first').addEventListener('click', () => {
    pages = [0];
    refresh();
  });
  document.getElementById('timeline-previous').addEventListener('click', () => {
    if (pages.length > 1) pages.pop();
    refresh();
  });
  document.getElementById('timeline-next').addEventListener('click', () => {
    if (next !== null) pages.push(next);
    refresh();
  });

  if (!id) {
    show('No aggregate named: open this page as /console/aggregate?id=AGGREGATE.');
    return;
  }
  C.live({
    onReset: refresh,
    onChange: (change) => {
      if (change.aggregateId === id) refresh();
    },
  });
  refresh();
})();
