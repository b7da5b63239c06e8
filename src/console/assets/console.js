// production-lab console: the helpers every page shares. Whatever came from a request is put into
// the page as text (text nodes and textContent), never parsed as markup.
'use strict';

const LabConsole = (() => {
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

  /**
   * One path segment holding an id: every character but letters, digits, '-', '_' and '~' is
   * percent-encoded, so an id can neither end its segment nor start a query. A segment `.` or
   * `..` cannot be sent at all: a browser drops it (even written `%2E`) and the request would
   * reach another route, so such an id is refused here and goes into a query instead.
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
   * The address of a route on this server: its path segments (fixed words and ids alike go
   * through `segment`) and its query parameters (an absent or empty one is left out).
   */
  function address(segments, params = {}) {
    const given = Object.entries(params)
      .filter(([, value]) => value !== undefined && value !== null && value !== '')
      .map(([name, value]) => [name, String(value)]);
    const query = new URLSearchParams(given).toString();
    return `/${segments.map(segment).join('/')}${query ? `?${query}` : ''}`;
  }

  /** A console page's address with query parameters. */
  function pageUrl(path, params) {
    return `${path}?${new URLSearchParams(params)}`;
  }

  function link(path, params, text) {
    return el('a', { href: pageUrl(path, params), text });
  }

  /**
   * The address parameters of a dead letter's page: its message id, and its producer when a
   * producer delivered it (a message id belongs to its producer).
   */
  function deadLetterParams(letter) {
    return letter.producer ? { id: letter.messageId, producer: letter.producer } : { id: letter.messageId };
  }

  /** The query parameter `name` of this page's address, or ''. */
  function param(name) {
    return new URLSearchParams(window.location.search).get(name) || '';
  }

  /**
   * Sends a request to this server and reads the answer as JSON:
   * `{status, ok, body}`. A token goes only into the Authorization header.
   */
  async function request(method, path, { body, token } = {}) {
    const headers = { accept: 'application/json' };
    if (body !== undefined) headers['content-type'] = 'application/json';
    if (token) headers.authorization = `Bearer ${token}`;
    const response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
      credentials: 'same-origin',
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

  function get(path) {
    return request('GET', path);
  }

  /** Reads a list route and fails with its problem's words when it does not answer 200. */
  async function getOk(path) {
    const answer = await get(path);
    if (!answer.ok) throw new Error(problemText(answer));
    return answer.body;
  }

  /** "STATUS title: detail" of a problem answer. */
  function problemText(answer) {
    const body = answer.body || {};
    const words = [body.title, body.detail].filter(Boolean).join(': ');
    return `${answer.status}${words ? ` ${words}` : ''}`;
  }

  /**
   * Fills a table's body with one row per item; `columns` are functions from an item to a cell's
   * text (or a node). Each cell carries its column's name for the narrow layout.
   */
  function fillTable(id, items, columns, { rowClass } = {}) {
    const table = document.getElementById(id);
    const labels = Array.from(table.tHead.rows[0].cells, (cell) => cell.textContent);
    const rows = items.map((item) => {
      const row = el('tr', { class: rowClass ? rowClass(item) : undefined });
      columns.forEach((column, index) => {
        const value = column(item);
        const cell = el('td', { 'data-label': labels[index] });
        cell.append(value instanceof Node ? value : display(value));
        row.append(cell);
      });
      return row;
    });
    table.tBodies[0].replaceChildren(...rows);
    table.hidden = items.length === 0;
    table.dataset.count = String(items.length);
    const empty = document.querySelector(`[data-empty-for="${id}"]`);
    if (empty) empty.hidden = items.length > 0;
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

  /** Runs `load` soon, once for any number of calls in between, one run at a time. */
  function refresher(load, onError) {
    let scheduled = false;
    let chain = Promise.resolve();
    return () => {
      if (scheduled) return;
      scheduled = true;
      setTimeout(() => {
        scheduled = false;
        chain = chain.then(load).catch(onError);
      }, 50);
    };
  }

  /**
   * Follows `GET /console/events`: `onReset` when connected (and after missed events), `onChange`
   * with each committed change. Shows the connection's state in the top bar.
   */
  function live({ onReset, onChange }) {
    const indicator = document.getElementById('live');
    const show = (state, text) => {
      indicator.dataset.state = state;
      indicator.textContent = text;
    };
    let source = null;
    const connect = () => {
      source = new EventSource('/console/events');
      source.addEventListener('hello', () => {
        show('live', 'live');
        onReset();
      });
      source.addEventListener('lagged', () => onReset());
      source.addEventListener('change', (event) => {
        let change = null;
        try {
          change = JSON.parse(event.data);
        } catch {
          onReset();
          return;
        }
        onChange(change);
      });
      source.addEventListener('error', (event) => {
        if (event.target.readyState === EventSource.CLOSED && event.target === source) {
          // Refused (too many streams) or the server is gone: try again a little later.
          show('reconnecting', 'not live: retrying');
          setTimeout(connect, 10000);
        } else {
          show('reconnecting', 'reconnecting');
        }
      });
    };
    // A page the browser keeps for going back (the back/forward cache) must not keep its stream:
    // browsers allow six connections to one server, and each kept page would hold one.
    window.addEventListener('pagehide', () => {
      if (source) source.close();
      source = null;
    });
    window.addEventListener('pageshow', (event) => {
      if (event.persisted && !source) connect();
    });
    connect();
  }

  /** A tone for an outcome or status, so colour can back up the words. */
  function tone(word) {
    if (['applied', 'replay', 'resolved', 'dry run', 'flowing'].includes(word)) return 'good';
    if (['gap', 'stale', 'payload conflict', 'waiting', 'superseded'].includes(word)) return 'warn';
    return 'bad';
  }

  return {
    el, display, time, duration, segment, address, pageUrl, link, deadLetterParams, param, request, get, getOk, problemText,
    fillTable, fillFacts, refresher, live, tone,
  };
})();
