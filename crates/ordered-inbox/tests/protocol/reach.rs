//! A liveness check `stateright` does not make: that from every reachable state some
//! continuation still settles every message (no deadlock, no livelock that every schedule is
//! trapped in). `eventually` only judges the paths that end; a cycle of naks and redeliveries
//! is ignored by it. This enumerates the whole graph, then walks back from the settled states.

use std::collections::{HashMap, VecDeque};

use stateright::Model;

use super::model::{Protocol, State};
use super::properties::settled;

pub struct Reach {
    /// The reachable states.
    pub states: usize,
    /// One reachable state from which no run settles, if there is one.
    pub stuck: Option<String>,
}

pub fn explore(protocol: &Protocol) -> Reach {
    let mut index: HashMap<State, usize> = HashMap::new();
    let mut states: Vec<State> = Vec::new();
    let mut predecessors: Vec<Vec<usize>> = Vec::new();
    let mut queue = VecDeque::new();
    for initial in protocol.init_states() {
        let id = add(&mut index, &mut states, &mut predecessors, initial);
        queue.push_back(id);
    }
    while let Some(id) = queue.pop_front() {
        for next in protocol.next_states(&states[id]) {
            let known = index.get(&next).copied();
            let next_id = known.unwrap_or_else(|| {
                let added = add(&mut index, &mut states, &mut predecessors, next);
                queue.push_back(added);
                added
            });
            predecessors[next_id].push(id);
        }
    }
    let can_settle = backwards(protocol, &states, &predecessors);
    let stuck = can_settle
        .iter()
        .position(|&settles| !settles)
        .map(|id| format!("{:#?}", states[id]));
    Reach {
        states: states.len(),
        stuck,
    }
}

fn add(
    index: &mut HashMap<State, usize>,
    states: &mut Vec<State>,
    predecessors: &mut Vec<Vec<usize>>,
    state: State,
) -> usize {
    let id = states.len();
    index.insert(state.clone(), id);
    states.push(state);
    predecessors.push(Vec::new());
    id
}

/// Which states reach a settled one: every settled state, and every predecessor of one that
/// does.
fn backwards(protocol: &Protocol, states: &[State], predecessors: &[Vec<usize>]) -> Vec<bool> {
    let mut reaches = vec![false; states.len()];
    let mut queue: VecDeque<usize> = (0..states.len())
        .filter(|&id| settled(protocol, &states[id]))
        .collect();
    for &id in &queue {
        reaches[id] = true;
    }
    while let Some(id) = queue.pop_front() {
        for &before in &predecessors[id] {
            if !reaches[before] {
                reaches[before] = true;
                queue.push_back(before);
            }
        }
    }
    reaches
}
