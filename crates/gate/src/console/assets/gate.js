// The gate console: the helpers its pages share beyond the ones both consoles share
// (`ConsoleCommon`, loaded first). Whatever came from a request is put into the page as text
// (text nodes and textContent), never parsed as markup. The token lives in this tab's
// sessionStorage only and goes only into the Authorization header.
'use strict';

const Gate = (() => {
  const { el, address, problemText, paragraph } = ConsoleCommon;
  const TOKEN = 'gate-console.token';
  const ROLE = 'gate-console.role';
  const NOTICE = 'gate-console.notice';
  const RETURN_TO = 'gate-console.return-to';

  /** Seconds since a stored timestamp, or null. */
  function secondsSince(value) {
    const at = Date.parse(value || '');
    return Number.isFinite(at) ? (Date.now() - at) / 1000 : null;
  }

  /** A missing range in words: "3–5", or "3 and beyond" when nothing ahead is known. */
  function range(missing) {
    if (!missing) return null;
    return missing.through === null || missing.through === undefined
      ? `${missing.from} and beyond`
      : `${missing.from}–${missing.through}`;
  }

  /** A link to a console page, its ids in the query. */
  function link(path, params, text) {
    const query = address([], params).slice(1);
    return el('a', { href: `${path}${query}`, text });
  }

  /** The link to a dead letter's page: its message id, and its producer when a producer's. */
  function deadLetterLink(letter, text) {
    return link('/console/deadletter', { messageId: letter.messageId, producer: letter.producer }, text || letter.messageId);
  }

  const session = {
    token: () => sessionStorage.getItem(TOKEN) || '',
    role: () => sessionStorage.getItem(ROLE) || '',
    isOperator: () => sessionStorage.getItem(ROLE) === 'operator',
    start(token, role) {
      sessionStorage.setItem(TOKEN, token);
      sessionStorage.setItem(ROLE, role);
    },
    /** Forgets the token and goes to sign-in, which shows `notice`; this page comes back after. */
    end(notice, comeBack = true) {
      sessionStorage.removeItem(TOKEN);
      sessionStorage.removeItem(ROLE);
      if (notice) sessionStorage.setItem(NOTICE, notice);
      const here = `${window.location.pathname}${window.location.search}`;
      if (comeBack && here.startsWith('/console/')) sessionStorage.setItem(RETURN_TO, here);
      window.location.assign('/console');
    },
    /** The sign-in page's notice, read once. */
    takeNotice() {
      const notice = sessionStorage.getItem(NOTICE) || '';
      sessionStorage.removeItem(NOTICE);
      return notice;
    },
    /** Where to go after signing in (a console page of this origin), read once. */
    takeReturn() {
      const back = sessionStorage.getItem(RETURN_TO) || '';
      sessionStorage.removeItem(RETURN_TO);
      return back.startsWith('/console/') ? back : '';
    },
  };

  /** Sends a request with `token`, no cookies, and reads the answer as JSON: `{status, ok, body}`. */
  function send(method, path, options = {}) {
    return ConsoleCommon.request(method, path, { ...options, credentials: 'omit' });
  }

  /**
   * A call with the session's token. A 401 ends the session: the user is sent back to sign-in,
   * which shows the problem's words.
   */
  async function call(method, path, body) {
    const answer = await send(method, path, { body, token: session.token() });
    if (answer.status === 401) {
      const problem = answer.body || {};
      session.end(`${problem.title || 'Not authorized'}: ${problem.detail || 'sign in again'}`);
      throw new Error('signed out');
    }
    return answer;
  }

  /** A read that must answer 200; else fails with the problem's words. */
  async function read(path) {
    const answer = await call('GET', path);
    if (!answer.ok) throw new Error(problemText(answer));
    return answer.body;
  }

  /** A tone for a status or outcome, so colour can back up the words. */
  function tone(word) {
    if (['applied', 'resolved', 'dry run', 'flowing'].includes(word)) return 'good';
    if (['waiting', 'superseded', 'gap'].includes(word)) return 'warn';
    return 'bad';
  }

  function status(word) {
    return el('span', { text: word, 'data-tone': tone(word) });
  }

  /** Shows (or with '' hides) the page's problem line. */
  function showProblem(message) {
    const line = document.getElementById('page-error');
    line.textContent = message;
    line.hidden = !message;
  }

  /**
   * The page's start: without a token, back to sign-in (and here again after); with one, the
   * top bar says who is signed in, and `start` runs.
   */
  function page(start, { signInHere = false } = {}) {
    const who = document.getElementById('who');
    const signOut = document.getElementById('sign-out');
    if (!session.token()) {
      if (!signInHere) {
        session.end('Sign in to read this page.');
        return;
      }
      start();
      return;
    }
    who.textContent = `signed in: ${session.role()}`;
    who.dataset.state = 'live';
    signOut.hidden = false;
    signOut.addEventListener('click', () => session.end('Signed out.', false));
    Promise.resolve()
      .then(start)
      .catch((error) => {
        if (error.message !== 'signed out') showProblem(error.message);
      });
  }

  /** A refused answer in words: the status, what the gate said, and that nothing changed. */
  function refusal(answer) {
    const body = answer.body || {};
    const lines = [
      paragraph(`${answer.status} — refused, nothing was changed: ${body.title || 'refused'}.`, { class: 'headline' }),
    ];
    if (body.detail) lines.push(paragraph(body.detail));
    return lines;
  }

  return {
    ...ConsoleCommon, secondsSince, range, link, deadLetterLink, session, send, call, read, status,
    showProblem, page, refusal,
  };
})();
