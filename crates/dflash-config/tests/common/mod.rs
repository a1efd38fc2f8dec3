//! Helpers shared by the integration tests: JSON-pointer edits on fixtures.

#![allow(dead_code)] // reason: each test binary uses a different subset

use serde_json::Value;

/// Parse a fixture (the bundled examples are valid JSON by construction).
pub fn doc(text: &str) -> Value {
    serde_json::from_str(text).expect("bundled fixture is valid JSON")
}

/// Set the value at JSON pointer `ptr` (the parent must exist; object keys are inserted).
pub fn set(v: &mut Value, ptr: &str, new: Value) {
    let (parent, last) = ptr.rsplit_once('/').expect("pointer has a slash");
    match v.pointer_mut(parent).expect("parent exists") {
        Value::Object(m) => {
            m.insert(last.to_owned(), new);
        }
        Value::Array(a) => {
            let i: usize = last.parse().expect("array index");
            a[i] = new;
        }
        other => panic!("cannot set {ptr} in {other}"),
    }
}

/// Remove the value at JSON pointer `ptr` (an object key or an array element).
pub fn del(v: &mut Value, ptr: &str) {
    let (parent, last) = ptr.rsplit_once('/').expect("pointer has a slash");
    match v.pointer_mut(parent).expect("parent exists") {
        Value::Object(m) => {
            m.shift_remove(last).expect("key exists");
        }
        Value::Array(a) => {
            let i: usize = last.parse().expect("array index");
            a.remove(i);
        }
        other => panic!("cannot delete {ptr} in {other}"),
    }
}
