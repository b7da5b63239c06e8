// production-lab console: the helpers its pages share beyond the ones both consoles share
// (`ConsoleCommon`, loaded first). Whatever came from a request is put into the page as text
// (text nodes and textContent), never parsed as markup.
'use strict';

const LabConsole = (() => {
  const { el, problemText } = ConsoleCommon;

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

  /** A request to this server with this origin's cookies: `{status, ok, body}`. */
  function request(method, path, options = {}) {
    return ConsoleCommon.request(method, path, { ...options, credentials: 'same-origin' });
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
    ...ConsoleCommon, pageUrl, link, deadLetterParams, request, get, getOk, refresher, live, tone,
  };
})();
