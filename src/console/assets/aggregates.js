// Aggregates: the inventory by status (blocked first, the longest in its status first) and the
// open dead letters, following changes as they commit.
'use strict';

(() => {
  const C = LabConsole;
  const STATUSES = ['blocked', 'waiting', 'flowing'];
  const LIMIT = 100;

  const filter = document.getElementById('status-filter');
  const count = document.getElementById('inventory-count');
  const error = (problem) => {
    count.textContent = `Could not read the inventory: ${problem.message}`;
  };

  let loadedAt = Date.now();
  let ageCells = [];

  const initial = C.param('status');
  if (STATUSES.includes(initial)) filter.value = initial;

  async function load() {
    const wanted = filter.value ? [filter.value] : STATUSES;
    const lists = await Promise.all(
      wanted.map((status) => C.getOk(C.address(['aggregates'], { status, limit: LIMIT }))),
    );
    const open = await C.getOk(C.address(['deadletters'], { status: 'open', limit: LIMIT }));
    loadedAt = Date.now();
    const entries = lists.flatMap((list) => list.aggregates);
    ageCells = [];
    C.fillTable('inventory', entries, [
      (a) => C.link('/console/aggregate', { id: a.aggregateId }, a.aggregateId),
      (a) => {
        const word = C.el('span', { text: a.status, 'data-tone': C.tone(a.status) });
        return word;
      },
      (a) => {
        const cell = C.el('span', { text: C.duration(a.ageSeconds) });
        ageCells.push([cell, a.ageSeconds]);
        return cell;
      },
      (a) => a.last,
      (a) => a.expected,
      (a) => a.openDeadLetters,
      (a) => a.held,
      (a) => (a.missing ? (a.missing.from === a.missing.through ? `${a.missing.from}` : `${a.missing.from}–${a.missing.through}`) : ''),
      (a) => C.time(a.since),
    ]);
    const perStatus = wanted
      .map((status, index) => `${lists[index].aggregates.length} ${status}`)
      .join(', ');
    const cut = lists.some((list) => list.aggregates.length >= LIMIT)
      ? ` (the first ${LIMIT} of each status)`
      : '';
    count.textContent = `${entries.length} shown: ${perStatus}${cut}`;
    C.fillTable('open-deadletters', open.deadLetters, [
      (d) => C.link('/console/deadletter', C.deadLetterParams(d), d.messageId),
      (d) => C.link('/console/aggregate', { id: d.aggregateId || '' }, d.aggregateId || '—'),
      (d) => d.sequence,
      (d) => d.reason,
      (d) => d.observations,
      (d) => C.time(d.firstSeen),
    ]);
  }

  // Ages move on between updates without asking the server.
  setInterval(() => {
    const elapsed = (Date.now() - loadedAt) / 1000;
    for (const [cell, age] of ageCells) cell.textContent = C.duration(age + elapsed);
  }, 1000);

  const refresh = C.refresher(load, error);
  filter.addEventListener('change', () => {
    window.history.replaceState(null, '', C.address(['console', 'aggregates'], { status: filter.value }));
    refresh();
  });
  C.live({ onReset: refresh, onChange: refresh });
  refresh();
})();
