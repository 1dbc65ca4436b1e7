//! Categories: what every live byte is for. Each live block carries one; the sums over
//! categories always equal `memory_allocated`.
//!
//! A block's category follows its role, not its birth: a tensor assigned to `.grad` becomes
//! `Gradient`; an op output that the autograd graph saves for backward counts as
//! `SavedActivation` while the graph holds it (and falls back to `Temporary` when released).

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Category {
    Parameter,
    Gradient,
    SavedActivation,
    OptimizerState,
    Input,
    Workspace,
    Temporary,
}

impl Category {
    pub const ALL: [Category; 7] = [
        Category::Parameter,
        Category::Gradient,
        Category::SavedActivation,
        Category::OptimizerState,
        Category::Input,
        Category::Workspace,
        Category::Temporary,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::Parameter => "parameter",
            Category::Gradient => "gradient",
            Category::SavedActivation => "saved_activation",
            Category::OptimizerState => "optimizer_state",
            Category::Input => "input",
            Category::Workspace => "workspace",
            Category::Temporary => "temporary",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Whether the graph saving a block of this category re-labels it as a saved activation.
    /// Parameters and inputs saved for backward stay what they are: they exist anyway.
    pub(crate) fn becomes_saved_when_held_by_graph(self) -> bool {
        matches!(self, Category::Temporary)
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes per category (indexed by `Category::index`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CategoryBytes(pub [u64; 7]);

impl CategoryBytes {
    pub fn get(&self, c: Category) -> u64 {
        self.0[c.index()]
    }
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    pub(crate) fn add(&mut self, c: Category, bytes: u64) {
        self.0[c.index()] += bytes;
    }
    pub(crate) fn sub(&mut self, c: Category, bytes: u64) {
        self.0[c.index()] -= bytes;
    }
    /// (name, bytes) pairs in the fixed category order, zeros included.
    pub fn iter(&self) -> impl Iterator<Item = (Category, u64)> + '_ {
        Category::ALL.iter().map(move |&c| (c, self.get(c)))
    }
    /// Category name → bytes, for reports and JSON.
    pub fn to_map(&self) -> std::collections::BTreeMap<String, u64> {
        self.iter()
            .map(|(k, v)| (k.name().to_string(), v))
            .collect()
    }
}
