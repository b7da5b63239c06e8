// One aggregate: its state and open dead letters, its gaps (and for an operator the gap skip
// form, dry run first), the applied feed it emits and its timeline. The page follows the applied
// feed with a long poll and reads everything again when a message applies.
'use strict';

(() => {
  const G = Gate;
  const id = G.param('id');
  const PAGE = 100;
  const WAIT_MS = 25000;
  let applied = { next: 0, more: false };
  let timeline = { next: 0, more: false };
  // The gap form is filled from the first read only: what the operator saw is what they state.
  let prefilled = false;
  // The body of the last dry run that answered 200: the skip sends exactly it.
  let previewed = null;

  document.getElementById('aggregate-id').textContent = id;
  document.title = `Aggregate ${id} · gate console`;

  /** The `/v1/aggregates/{id}/…` address of this aggregate. */
  function route(rest = [], params = {}) {
    return G.address(['v1', 'aggregates', id, ...rest], params);
  }

  async function loadState() {
    const a = await G.read(route());
    const owner = a.owner ? `${a.owner.producer} (epoch ${a.owner.epoch})` : null;
    G.fillFacts('state', [
      ['status', G.status(a.status)],
      ['last', a.last],
      ['expected next', a.expected],
      ['since', G.time(a.since)],
      ['emitted', a.state ? a.state.emitted : null],
      ['owner', owner],
      ['open dead letters', a.openDeadLetterCount],
      ['held', a.heldCount],
    ]);
    G.fillTable('dead-letters', a.openDeadLetters, [
      (d) => G.deadLetterLink(d),
      (d) => d.producer,
      (d) => d.sequence,
      (d) => d.reason,
    ]);
    return a;
  }

  async function loadGaps(a) {
    const g = await G.read(route(['gaps']));
    G.fillFacts('gaps', [
      ['missing', G.range(g.missing) || 'nothing'],
      ['waiting since', G.time(g.waitingSince)],
      ['held sequences', g.heldSequences.length ? g.heldSequences.join(', ') : null],
    ]);
    if (!G.session.isOperator()) {
      document.getElementById('gap-reader').hidden = false;
      return;
    }
    document.getElementById('gap-operator').hidden = !g.missing;
    if (g.missing && !prefilled) {
      const through = g.missing.through ?? g.missing.from;
      document.getElementById('gap-from').value = String(g.missing.from);
      document.getElementById('gap-through').value = String(through);
      document.getElementById('gap-expected-last').value = String(a.last);
      prefilled = true;
    }
  }

  async function loadApplied(append) {
    const after = append ? applied.next : 0;
    const body = await G.read(route(['applied'], { after, limit: PAGE }));
    G.fillTable('applied', body.messages, [
      (m) => m.sequence,
      (m) => m.messageId,
      (m) => m.type,
      (m) => G.el('code', { text: JSON.stringify(m.payload) }),
      (m) => G.time(m.appliedAt),
    ], { append });
    applied = { next: body.next, more: body.messages.length === PAGE };
    document.getElementById('applied-more').hidden = !applied.more;
  }

  async function loadTimeline(append) {
    const after = append ? timeline.next : 0;
    const body = await G.read(route(['timeline'], { after, limit: PAGE }));
    G.fillTable('timeline', body.events, [
      (e) => e.id,
      (e) => G.time(e.at),
      (e) => e.kind,
      (e) => e.sequence,
      (e) => e.messageId,
      (e) => e.detail,
    ], { append });
    timeline = { next: body.next, more: body.next !== null };
    document.getElementById('timeline-more').hidden = !timeline.more;
  }

  async function load() {
    G.showProblem('');
    const a = await loadState();
    await Promise.all([loadGaps(a), loadApplied(false), loadTimeline(false)]);
  }

  /** Waits on the applied feed after the last sequence shown, and reads all again on news. */
  async function follow() {
    const status = document.getElementById('follow');
    for (;;) {
      status.textContent = 'following the applied feed';
      const answer = await G.call('GET', route(['applied'], { after: applied.next, limit: 1, waitMs: WAIT_MS }));
      if (!answer.ok) {
        status.textContent = `not following: ${G.problemText(answer)}`;
        return;
      }
      if (answer.body.messages.length > 0) await load();
    }
  }

  /** The gap form's body, or a sentence saying what is missing. */
  function readGapForm() {
    const number = (field) => document.getElementById(field).valueAsNumber;
    const body = {
      action: 'skip',
      from: number('gap-from'),
      through: number('gap-through'),
      expectedLast: number('gap-expected-last'),
      reason: document.getElementById('gap-reason').value,
    };
    for (const name of ['from', 'through', 'expectedLast']) {
      if (!Number.isFinite(body[name])) return { missing: `${name}: enter a whole number.` };
    }
    return { body };
  }

  function describeGap(r) {
    const drained = r.drained.length
      ? `; then ${r.drained.map((m) => `${m.sequence} (${m.messageId})`).join(', ')} drain`
      : '';
    return [
      G.paragraph(`skip sequences ${r.range.from} through ${r.range.through} of ${r.aggregateId}, by ${r.operator}: "${r.reason}"`),
      G.paragraph(`last ${r.before.last} → ${r.after.last}${drained}`),
    ];
  }

  async function submitGap(dryRun) {
    const input = readGapForm();
    if (input.missing) {
      G.result('gap-result', 'incomplete', 'refusal', [G.paragraph(`Not sent: ${input.missing}`)]);
      return;
    }
    const body = dryRun ? input.body : previewed;
    const answer = await G.call('POST', route(['gaps', 'resolution'], { dryRun: dryRun ? 'true' : undefined }), body);
    const skip = document.getElementById('gap-skip');
    if (!answer.ok) {
      previewed = null;
      skip.disabled = true;
      G.result('gap-result', String(answer.status), 'refusal', G.refusal(answer));
      return;
    }
    if (dryRun) {
      previewed = input.body;
      skip.disabled = false;
      G.result('gap-result', 'preview', 'preview', [
        G.paragraph('Preview (dry run): nothing was written. Skipping would do this:', { class: 'headline' }),
        ...describeGap(answer.body),
      ]);
      return;
    }
    previewed = null;
    skip.disabled = true;
    G.result('gap-result', 'resolved', 'success', [
      G.paragraph(`Skipped: resolution #${answer.body.resolutionId}.`, { class: 'headline' }),
      ...describeGap(answer.body),
    ]);
    await load();
  }

  const failed = (error) => {
    if (error.message !== 'signed out') G.showProblem(error.message);
  };

  G.page(() => {
    if (!id) {
      G.showProblem('No aggregate named: open this page as /console/aggregate?id=AGGREGATE_ID.');
      return undefined;
    }
    G.segment(id);
    const form = document.getElementById('gap-form');
    // Any edit after a preview asks for a new one: the skip sends only what was previewed.
    form.addEventListener('input', () => {
      previewed = null;
      document.getElementById('gap-skip').disabled = true;
    });
    document.getElementById('gap-preview').addEventListener('click', () => submitGap(true).catch(failed));
    document.getElementById('gap-skip').addEventListener('click', () => submitGap(false).catch(failed));
    document.getElementById('refresh').addEventListener('click', () => load().catch(failed));
    document.getElementById('applied-more').addEventListener('click', () => loadApplied(true).catch(failed));
    document.getElementById('timeline-more').addEventListener('click', () => loadTimeline(true).catch(failed));
    return load().then(() => {
      follow().catch(failed);
    });
  });
})();
