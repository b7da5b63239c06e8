// Labs at a glance: each lab's evidence from its own read route, read-only.
'use strict';

(() => {
  const C = LabConsole;
  const PANELS = [
    { title: 'Classroom aggregate demo', path: '/ordered/state' },
    { title: 'Outbox and idempotent inbox', path: '/messaging/counts' },
    { title: 'Cache stampede', path: '/cache/stats' },
    { title: 'Worker queue', path: '/lab/worker/queue' },
    { title: 'Worker scopes', path: '/worker/evidence' },
    { title: 'Live configuration', path: '/configuration' },
    { title: 'Privacy evidence', path: '/privacy/evidence' },
    { title: 'Conditional pipeline', path: '/pipeline/state' },
    { title: 'Antiforgery submissions', path: '/antiforgery/count' },
    { title: 'Race probe', path: '/lab/condition/evidence' },
  ];
  const REFRESH_EVERY = 5000;

  const container = document.getElementById('lab-panels');
  const refreshed = document.getElementById('refreshed');

  const panels = PANELS.map((panel) => {
    const facts = C.el('dl', { class: 'facts' });
    const status = C.el('p', { class: 'muted' });
    const section = C.el(
      'section',
      { class: 'panel', 'data-path': panel.path },
      C.el('h2', { text: panel.title }),
      C.el('p', {}, C.el('code', { text: `GET ${panel.path}` })),
      status,
      facts,
    );
    container.append(section);
    return { ...panel, section, facts, status };
  });

  /** [name, value] pairs of a JSON body: nested objects as "a.b", lists as lists. */
  function flatten(value, prefix, out) {
    if (value !== null && typeof value === 'object' && !Array.isArray(value)) {
      const entries = Object.entries(value);
      if (entries.length === 0 && prefix) out.push([prefix, '(empty)']);
      for (const [key, inner] of entries) flatten(inner, prefix ? `${prefix}.${key}` : key, out);
    } else if (Array.isArray(value)) {
      if (value.length === 0) out.push([prefix, '(none)']);
      else out.push([prefix, C.el('ul', {}, ...value.map((item) => C.el('li', { text: C.display(item) })))]);
    } else {
      out.push([prefix || 'value', value]);
    }
    return out;
  }

  async function readPanel(panel) {
    try {
      const answer = await C.get(panel.path);
      panel.section.dataset.status = String(answer.status);
      if (answer.ok) {
        panel.status.textContent = '';
        panel.status.hidden = true;
        fill(panel, flatten(answer.body, '', []));
      } else {
        panel.status.hidden = false;
        panel.status.textContent = C.problemText(answer);
        fill(panel, []);
      }
    } catch (error) {
      panel.status.hidden = false;
      panel.status.textContent = `No answer: ${error.message}`;
    }
  }

  function fill(panel, pairs) {
    const nodes = [];
    for (const [term, value] of pairs) {
      nodes.push(C.el('dt', { text: term }));
      const dd = C.el('dd', { 'data-term': term });
      dd.append(value instanceof Node ? value : C.display(value));
      nodes.push(dd);
    }
    panel.facts.replaceChildren(...nodes);
  }

  async function load() {
    await Promise.all(panels.map(readPanel));
    refreshed.textContent = `Read at ${new Date().toLocaleTimeString()}`;
  }

  const refresh = C.refresher(load, () => {});
  document.getElementById('refresh').addEventListener('click', refresh);
  setInterval(refresh, REFRESH_EVERY);
  C.live({ onReset: refresh, onChange: refresh });
})();
