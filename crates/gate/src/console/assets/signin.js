// Sign-in and the inventory: a pasted token is checked against a reader's route (it must read)
// and an operator's (whether it may also resolve) before it is kept for this tab.
'use strict';

(() => {
  const G = Gate;
  const STATUSES = ['blocked', 'waiting', 'flowing'];
  const PAGE = 100;
  const signIn = document.getElementById('sign-in');
  const inventory = document.getElementById('inventory');
  const problem = document.getElementById('sign-in-problem');

  const showSignInProblem = (message) => {
    problem.textContent = message;
    problem.hidden = !message;
  };

  /** The role `token` has at this gate, or the words of the refusal. */
  async function roleOf(token) {
    const reads = await G.send('GET', G.address(['v1', 'aggregates'], { status: 'blocked', limit: 1 }), { token });
    if (!reads.ok) return { refused: G.problemText(reads) };
    const administers = await G.send('GET', G.address(['v1', 'operators']), { token });
    return { role: administers.ok ? 'operator' : 'reader' };
  }

  async function submit(event) {
    event.preventDefault();
    const field = document.getElementById('token');
    const token = field.value.trim();
    if (!token) {
      showSignInProblem('Paste a token first.');
      return;
    }
    const checked = await roleOf(token);
    if (checked.refused) {
      showSignInProblem(`Not signed in: ${checked.refused}`);
      return;
    }
    field.value = '';
    G.session.start(token, checked.role);
    const back = G.session.takeReturn();
    if (back) window.location.assign(back);
    else window.location.reload();
  }

  /** The first page of the aggregates in `status`, and whether more follow. */
  async function listed(status) {
    const body = await G.read(G.address(['v1', 'aggregates'], { status, limit: PAGE }));
    return { rows: body.aggregates, more: body.next !== null };
  }

  async function load() {
    const lists = await Promise.all(STATUSES.map(listed));
    const rows = lists.flatMap((list) => list.rows);
    G.fillTable('aggregates', rows, [
      (a) => G.link('/console/aggregate', { id: a.aggregateId }, a.aggregateId),
      (a) => G.status(a.status),
      (a) => a.last,
      (a) => G.range(a.missing),
      (a) => (a.waitingSince ? G.duration(G.secondsSince(a.waitingSince) ?? a.ageSeconds) : null),
      (a) => G.duration(a.ageSeconds),
      (a) => a.openDeadLetters,
      (a) => a.held,
    ]);
    const cut = STATUSES.filter((_, index) => lists[index].more);
    document.getElementById('inventory-note').textContent = cut.length
      ? `Showing the first ${PAGE} of each status; more are ${cut.join(', ')}.`
      : `${rows.length} aggregate(s), read at ${new Date().toLocaleTimeString()}.`;
  }

  G.page(() => {
    const notice = G.session.takeNotice();
    if (!G.session.token()) {
      signIn.hidden = false;
      showSignInProblem(notice);
      document.getElementById('sign-in-form').addEventListener('submit', (event) => {
        submit(event).catch((error) => showSignInProblem(`Could not check the token: ${error.message}`));
      });
      return undefined;
    }
    inventory.hidden = false;
    document.getElementById('refresh').addEventListener('click', () => {
      load().catch((error) => G.showProblem(error.message));
    });
    return load();
  }, { signInHere: true });
})();
