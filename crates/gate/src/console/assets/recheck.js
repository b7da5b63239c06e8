// An operator's recheck (or bulk skip) of the open dead letters a filter matches: a dry run
// first, then the run with exactly the previewed values, then what happened per aggregate.
'use strict';

(() => {
  const G = Gate;
  const form = document.getElementById('recheck-form');
  const runButton = document.getElementById('run');
  // The operation and body of the last dry run that answered 200: the run sends exactly them.
  let previewed = null;

  function chosenOperation() {
    const checked = form.querySelector('input[name="operation"]:checked');
    return checked ? checked.value : 'recheck';
  }

  /** The request body from the form, or a sentence saying what is wrong. */
  function readForm() {
    const body = { reason: document.getElementById('reason').value };
    const optional = [
      ['type', 'filter-type'],
      ['aggregatePrefix', 'filter-prefix'],
      ['reasonContains', 'filter-reason'],
      ['openedBefore', 'filter-before'],
    ];
    for (const [name, id] of optional) {
      const value = document.getElementById(id).value.trim();
      if (value) body[name] = value;
    }
    const limit = document.getElementById('filter-limit').valueAsNumber;
    if (!Number.isInteger(limit)) return { missing: 'the limit must be a whole number from 1 to 500.' };
    body.limit = limit;
    return { operation: chosenOperation(), body };
  }

  /** `messageId` (sequence) of each entry, with its `why` when it has one. */
  function entries(list) {
    const items = (list || []).map((entry) => {
      const at = entry.sequence === null || entry.sequence === undefined ? '' : ` (${entry.sequence})`;
      const why = entry.why ? `: ${entry.why}` : '';
      return G.el('li', { text: `${entry.messageId}${at}${why}` });
    });
    return items.length ? G.el('ul', { class: 'plain' }, ...items) : '—';
  }

  function showAggregates(answer) {
    const resolved = answer.operation === 'skip' ? 'skipped' : 'applied';
    G.fillTable('recheck-aggregates', answer.body.aggregates || [], [
      (a) => G.link('/console/aggregate', { id: a.aggregateId }, a.aggregateId),
      (a) => entries(a[resolved]),
      (a) => entries(a.failing),
      (a) => entries(a.conflicts),
      (a) => entries(a.drained),
    ]);
  }

  /** The headline counts of an answer. */
  function summary(operation, body) {
    const aggregates = body.aggregates || [];
    const count = (list) => aggregates.reduce((sum, a) => sum + (a[list] || []).length, 0);
    const resolved = operation === 'skip' ? count('skipped') : count('applied');
    const parts = [
      `${body.matched} matched`,
      `${resolved} ${operation === 'skip' ? 'skipped' : 'applied'}`,
    ];
    if (operation === 'recheck') parts.push(`${count('failing')} still failing`);
    parts.push(`${count('conflicts')} not now`, `${count('drained')} drained`);
    const lines = [G.paragraph(parts.join(', ') + '.')];
    if (body.generation !== undefined) {
      lines.push(G.paragraph(`Checked against configuration generation ${body.generation}.`));
    }
    if (body.next !== null && body.next !== undefined) {
      lines.push(G.paragraph('More open dead letters remain after these: run again to go on.'));
    }
    return lines;
  }

  async function submit(dryRun) {
    const input = readForm();
    if (input.missing) {
      G.result('recheck-result', 'incomplete', 'refusal', [G.paragraph(`Not sent: ${input.missing}`)]);
      return;
    }
    const sent = dryRun ? input : previewed;
    const path = G.address(['v1', 'deadletters', sent.operation], { dryRun: dryRun ? 'true' : undefined });
    G.result('recheck-result', 'sending', 'preview', [G.paragraph(dryRun ? 'Previewing…' : 'Running…')]);
    const answer = await G.call('POST', path, sent.body);
    if (!answer.ok) {
      previewed = null;
      runButton.disabled = true;
      G.result('recheck-result', String(answer.status), 'refusal', G.refusal(answer));
      return;
    }
    showAggregates({ operation: sent.operation, body: answer.body });
    if (dryRun) {
      previewed = input;
      runButton.disabled = false;
      G.result('recheck-result', 'preview', 'preview', [
        G.paragraph('Preview (dry run): nothing was written. Running would do this:', { class: 'headline' }),
        ...summary(sent.operation, answer.body),
      ]);
      return;
    }
    previewed = null;
    runButton.disabled = true;
    G.result('recheck-result', 'done', 'success', [
      G.paragraph('Done: each one resolved is recorded in the audit trail.', { class: 'headline' }),
      ...summary(sent.operation, answer.body),
    ]);
  }

  const failed = (error) => {
    if (error.message !== 'signed out') G.showProblem(error.message);
  };

  G.page(() => {
    const operator = G.session.isOperator();
    document.getElementById('recheck').hidden = !operator;
    document.getElementById('recheck-reader').hidden = operator;
    // Any edit after a preview asks for a new one: the run sends only what was previewed.
    form.addEventListener('input', () => {
      previewed = null;
      runButton.disabled = true;
    });
    form.addEventListener('submit', (event) => event.preventDefault());
    document.getElementById('preview').addEventListener('click', () => submit(true).catch(failed));
    runButton.addEventListener('click', () => submit(false).catch(failed));
    return undefined;
  });
})();
