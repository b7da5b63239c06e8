// The helpers both consoles (the lab's and the gate's) share, loaded before each console's own
// script. Whatever came from a request is put into the page as text (text nodes and
// textContent), never parsed as markup.
'use strict';

const ConsoleCommon = (() => {
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

  /**
   * An SVG element, as `el` builds an HTML one: attributes (`text` sets its text) and children.
   * SVG lives in its own namespace, so `el` cannot build it.
   */
  function svg(tag, attributes = {}, ...children) {
    const node = document.createElementNS('http://www.w3.org/2000/svg', tag);
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
   * reach another route, so such an id is refused here (and goes into a query instead).
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

  /** The query parameter `name` of this page's address, or ''. */
  function param(name) {
    return new URLSearchParams(window.location.search).get(name) || '';
  }

  /**
   * Sends a request to this server and reads the answer as JSON: `{status, ok, body}`. A token
   * goes only into the Authorization header; `credentials` says whether cookies go along (by
   * default they do not).
   */
  async function request(method, path, { body, token, credentials = 'omit' } = {}) {
    const headers = { accept: 'application/json' };
    if (body !== undefined) headers['content-type'] = 'application/json';
    if (token) headers.authorization = `Bearer ${token}`;
    const response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
      credentials,
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
   * Fills a table's body with one row per item (or, with `append`, adds them after the rows it
   * has); `columns` are functions from an item to a cell's text (or a node), `rowClass` one
   * from an item to its row's class. Each cell carries its column's name for the narrow layout.
   */
  function fillTable(id, items, columns, { rowClass, append = false } = {}) {
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

  return {
    el, svg, display, time, duration, segment, address, param, request, problemText, fillTable,
    fillFacts, paragraph, result,
  };
})();
