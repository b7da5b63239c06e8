// One aggregate: its state, its open and closed dead letters, its timeline (paged) and its
// resolutions, following changes as they commit.
'use strict';

(() => {
  const C = LabConsole;
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
      ]);
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
      (r) => C.link('/console/deadletter', C.deadLetterParams(r), r.messageId),
      (r) => (r.replacement ? `replace with ${r.replacement.messageId} (amount ${r.replacement.amount})` : r.action),
      (r) => r.operator,
      (r) => r.reason,
      (r) => `${r.before.last} → ${r.after.last}`,
      (r) => C.time(r.resolvedAt),
    ]);
  }

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
