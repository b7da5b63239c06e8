// The gate console: the helpers every page shares. Whatever came from a request is put into the
// page as text (text nodes and textContent), never parsed as markup. The token lives in this
// tab's sessionStorage only and goes only into the Authorization header.
'use strict';

const Gate = (() => {
  const TOKEN = 'gate-console.token';
  const ROLE = 'gate-console.role';
  const NOTICE = 'gate-console.notice';
  const RETURN_TO = 'gate-console.return-to';

  /** An element with attributes (`text` sets its text) and children (strings become text). */
  function el(tag, attributes = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) {
      if (value === undefined || value === null || value === false) continue;
      if (name === 'text') node.textContent = String(value);
      else node.setAttribute(name, value === true ? '' : String(value));
    }
    node.append(...children.filter((child) => child !== null && child !== undefined));
    return node;
  }

  /** How a value reads in a cell: a dash for nothing, JSON for structures. */
  function display(value) {
    if (value === null || value === undefined || value === '') return '—';
    if (typeof value === 'object') return JSON.stringify(value);
    return String(value);
  }

  /** A stored timestamp, shortened to the second. */
  function time(value) {
    if (!value) return '—';
    return String(value).replace('T', ' ').replace(/\.\d+Z$/, 'Z');
  }

  /** Whole seconds as the largest two units: "42 s", "3 min 5 s", "2 h 4 min". */
  function duration(seconds) {
    const s = Math.max(0, Math.floor(seconds));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
  }

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

  /**
   * One path segment holding an id: every character but letters, digits, '-', '_' and '~' is
   * percent-encoded, so an id can neither end its segment nor start a query. A segment `.` or
   * `..` cannot be sent at all: a browser drops it (even written `%2E`) and the request would
   * reach another route, so such an id is refused here.
   */
  function segment(value) {
    const text = String(value);
    if (text === '.' || text === '..') {
      throw new Error(`'${text}' cannot be a path segment: the browser would drop it`);
    }
    return encodeURIComponent(text).replace(
      /[!'()*.]/g,
      (character) => `%${character.charCodeAt(0).toString(16).toUpperCase()}`,
    );
  }

  /**
   * The address of a route: its path segments (fixed words and ids alike go through `segment`)
   * and its query parameters (an absent or empty one is left out).
   */
  function address(segments, params = {}) {
    const given = Object.entries(params)
      .filter(([, value]) => value !== undefined && value !== null && value !== '')
      .map(([name, value]) => [name, String(value)]);
    const query = new URLSearchParams(given).toString();
    return `/${segments.map(segment).join('/')}${query ? `?${query}` : ''}`;
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

  /** The query parameter `name` of this page's address, or ''. */
  function param(name) {
    return new URLSearchParams(window.location.search).get(name) || '';
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

  /** Sends a request with `token` and reads the answer as JSON: `{status, ok, body}`. */
  async function send(method, path, { body, token } = {}) {
    const headers = { accept: 'application/json' };
    if (body !== undefined) headers['content-type'] = 'application/json';
    if (token) headers.authorization = `Bearer ${token}`;
    const response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
      credentials: 'omit',
    });
    const text = await response.text();
    let parsed = null;
    try {
      parsed = text ? JSON.parse(text) : null;
    } catch {
      parsed = { title: text };
    }
    return { status: response.status, ok: response.ok, body: parsed };
  }

  /** "STATUS title: detail" of a problem answer. */
  function problemText(answer) {
    const body = answer.body || {};
    const words = [body.title, body.detail].filter(Boolean).join(': ');
    return `${answer.status}${words ? ` ${words}` : ''}`;
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

  /**
   * Fills a table's body with one row per item; `columns` are functions from an item to a cell's
   * text (or a node). Each cell carries its column's name for the narrow layout.
   */
  function fillTable(id, items, columns, { append = false } = {}) {
    const table = document.getElementById(id);
    const labels = Array.from(table.tHead.rows[0].cells, (cell) => cell.textContent);
    const rows = items.map((item) => {
      const row = el('tr');
      columns.forEach((column, index) => {
        const value = column(item);
        const cell = el('td', { 'data-label': labels[index] });
        cell.append(value instanceof Node ? value : display(value));
        row.append(cell);
      });
      return row;
    });
    if (append) table.tBodies[0].append(...rows);
    else table.tBodies[0].replaceChildren(...rows);
    const count = table.tBodies[0].rows.length;
    table.hidden = count === 0;
    table.dataset.count = String(count);
    const empty = document.querySelector(`[data-empty-for="${id}"]`);
    if (empty) empty.hidden = count > 0;
  }

  /** Fills a `<dl>` from [term, value] pairs. */
  function fillFacts(id, pairs) {
    const list = document.getElementById(id);
    const nodes = [];
    for (const [term, value] of pairs) {
      nodes.push(el('dt', { text: term }));
      const dd = el('dd', { 'data-term': term });
      dd.append(value instanceof Node ? value : display(value));
      nodes.push(dd);
    }
    list.replaceChildren(...nodes);
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

  /** A paragraph of text. */
  function paragraph(text, attributes = {}) {
    return el('p', { ...attributes, text });
  }

  /** Shows `lines` in the result area `id`, in a box of `kind` (preview, success, refusal). */
  function result(id, state, kind, lines) {
    const area = document.getElementById(id);
    area.dataset.state = state;
    area.replaceChildren(el('div', { class: kind }, ...lines));
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
    el, display, time, duration, secondsSince, range, segment, address, link, deadLetterLink, param,
    session, send, call, read, problemText, fillTable, fillFacts, status, showProblem, page,
    paragraph, result, refusal,
  };
})();
