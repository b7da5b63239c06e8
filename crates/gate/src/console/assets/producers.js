// The registry, for an operator: producers and operators listed (never their tokens), added (the
// new token shown this once, in this page only), and revoked after a second click.
'use strict';

(() => {
  const G = Gate;

  /** A registry: its route, its table and form, and the columns of its rows. */
  const REGISTRIES = [
    {
      route: 'producers',
      table: 'producers',
      form: 'producer-form',
      name: 'producer-name',
      result: 'producer-result',
      columns: [
        (p) => p.name,
        (p) => p.currentEpoch,
        (p) => p.ownedAggregates,
        (p) => G.time(p.lastDeliveryAt),
        (p) => G.time(p.createdAt),
        (p) => G.time(p.revokedAt),
      ],
    },
    {
      route: 'operators',
      table: 'operators',
      form: 'operator-form',
      name: 'operator-name',
      result: 'operator-result',
      columns: [(o) => o.name, (o) => G.time(o.createdAt), (o) => G.time(o.revokedAt)],
    },
  ];

  /** A revoke button that asks once more before it sends. */
  function revokeButton(registry, member) {
    if (member.revokedAt) return null;
    const button = G.el('button', { type: 'button', text: 'Revoke', 'data-name': member.name });
    button.addEventListener('click', () => {
      if (button.dataset.armed !== 'true') {
        button.dataset.armed = 'true';
        button.textContent = `Revoke ${member.name}: click again`;
        return;
      }
      revoke(registry, member.name).catch(failed);
    });
    return button;
  }

  async function load(registry) {
    const body = await G.read(G.address(['v1', registry.route]));
    G.fillTable(registry.table, body[registry.route], [
      ...registry.columns,
      (member) => revokeButton(registry, member),
    ]);
  }

  async function revoke(registry, name) {
    let path;
    try {
      path = G.address(['v1', registry.route, name]);
    } catch (error) {
      G.result(registry.result, 'refused', 'refusal', [G.paragraph(`Not sent: ${error.message}.`)]);
      return;
    }
    const answer = await G.call('DELETE', path);
    if (!answer.ok) {
      G.result(registry.result, String(answer.status), 'refusal', G.refusal(answer));
      return;
    }
    G.result(registry.result, 'revoked', 'success', [
      G.paragraph(`${name} is revoked (at ${G.time(answer.body.revokedAt)}): its token no longer works.`),
    ]);
    await load(registry);
  }

  async function add(registry) {
    const field = document.getElementById(registry.name);
    const answer = await G.call('POST', G.address(['v1', registry.route]), { name: field.value.trim() });
    if (!answer.ok) {
      G.result(registry.result, String(answer.status), 'refusal', G.refusal(answer));
      return;
    }
    field.value = '';
    G.result(registry.result, 'added', 'success', [
      G.paragraph(`${answer.body.name} is registered. Its token, shown this once (it is not stored and cannot be shown again):`),
      G.el('pre', { class: 'payload token', text: answer.body.token }),
    ]);
    await load(registry);
  }

  const failed = (error) => {
    if (error.message !== 'signed out') G.showProblem(error.message);
  };

  G.page(() => {
    if (!G.session.isOperator()) {
      document.getElementById('reader-notice').hidden = false;
      return undefined;
    }
    document.getElementById('registry').hidden = false;
    for (const registry of REGISTRIES) {
      document.getElementById(registry.form).addEventListener('submit', (event) => {
        event.preventDefault();
        add(registry).catch(failed);
      });
    }
    return Promise.all(REGISTRIES.map(load));
  });
})();
