//! The library's choice enums as flag values (`--unavailable-policy`,
//! `--backend`, `--consistency`): their names on the command line and the
//! help line of each. Implemented here so that the library's types stay free
//! of `clap`.

use crate::cluster::Consistency;
use crate::engine::UnavailablePolicy;
use crate::store::redis::BackendKind;
use clap::builder::PossibleValue;
use clap::ValueEnum;

impl ValueEnum for UnavailablePolicy {
    fn value_variants<'a>() -> &'a [Self] {
        &[
            UnavailablePolicy::Error,
            UnavailablePolicy::Allow,
            UnavailablePolicy::Deny,
        ]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            UnavailablePolicy::Error => PossibleValue::new("error")
                .help("`ERR unknown \"<reason>\"`, as divvy answers when Redis fails"),
            UnavailablePolicy::Allow => {
                PossibleValue::new("allow").help("Fail open: `OK true <creditLimit> 0`")
            }
            UnavailablePolicy::Deny => {
                PossibleValue::new("deny").help("Fail closed: `OK false 0 -1`")
            }
        })
    }
}

impl ValueEnum for BackendKind {
    fn value_variants<'a>() -> &'a [Self] {
        &[BackendKind::Memory, BackendKind::Redis]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            BackendKind::Memory => {
                PossibleValue::new("memory").help("In this process's memory (the default)")
            }
            BackendKind::Redis => PossibleValue::new("redis")
                .help("In Redis, in divvy's key layout (single node; shares divvy's Redis)"),
        })
    }
}

impl ValueEnum for Consistency {
    fn value_variants<'a>() -> &'a [Self] {
        &[Consistency::Strict, Consistency::Fast]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            Consistency::Strict => PossibleValue::new(self.as_str())
                .help("After the shard's entry is committed by a majority of its replicas"),
            Consistency::Fast => PossibleValue::new(self.as_str())
                .help("At once from the leader's state; replicated in the background"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_has_a_name_that_parses_back() {
        fn check<T: ValueEnum + PartialEq + std::fmt::Debug>() {
            for value in T::value_variants() {
                let name = value.to_possible_value().unwrap();
                assert_eq!(T::from_str(name.get_name(), false).as_ref(), Ok(value));
            }
        }
        check::<UnavailablePolicy>();
        check::<BackendKind>();
        check::<Consistency>();
    }
}
