//! The least a client accepts from a coordinator: floors on the round's settings that the
//! client enforces itself, so that a coordinator that cheats (or was taken over) cannot
//! talk it into a round where a threshold of one, two neighbours or no noise would let the
//! coordinator learn its update.
//!
//! The coordinator picks a round's threshold, neighbourhood, party count and distributed
//! noise; the client checks them against its floors when it joins ([`ClientFloors::check`])
//! and again against the survivors it is told of before it reveals anything
//! ([`ClientFloors::check_survivors`]). A refusal says which setting fell short of which
//! floor.

use super::RoundConfig;
use super::graph::effective_degree;

/// A client's floors. The defaults refuse only rounds that are unsafe for any experiment;
/// a client that expects differential privacy sets [`min_noise_multiplier`](Self::min_noise_multiplier).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClientFloors {
    /// Fewest clients a round may select, and fewest inputs a revealed sum may hold
    /// (`--min-parties`). A sum of two inputs gives each client the other's update.
    pub min_parties: u32,
    /// Fewest neighbours a client shares its secrets with (`--min-neighbours`); a smaller
    /// complete graph (every other client a neighbour) is accepted.
    pub min_neighbours: usize,
    /// Smallest threshold: shares needed to rebuild a secret (`--min-threshold`).
    pub min_threshold: usize,
    /// Smallest noise multiplier of distributed differential privacy
    /// (`--min-noise-multiplier`), for the round as planned and for the survivors whose
    /// noise shares are really in the sum. 0 accepts rounds without noise.
    pub min_noise_multiplier: f64,
    /// Whether the round must run the consistency check (on unless
    /// `--allow-no-consistency-check`). Without it a coordinator that cheats can show
    /// each client its own survivor list on a sparse graph and rebuild a client's
    /// neighbours' mask keys along with its self-mask seed: enough to unmask it
    /// (`secagg::attacks`).
    pub require_consistency_check: bool,
}

impl Default for ClientFloors {
    fn default() -> Self {
        Self {
            min_parties: 3,
            min_neighbours: 2,
            min_threshold: 2,
            min_noise_multiplier: 0.0,
            require_consistency_check: true,
        }
    }
}

/// A round setting below a client's floor.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the round's {setting} is {found}, below this client's floor of {floor} ({flag})")]
pub struct BelowFloor {
    /// The setting, as the round names it.
    pub setting: &'static str,
    /// Its value in the round.
    pub found: String,
    /// The client's floor.
    pub floor: String,
    /// The client option that sets the floor.
    pub flag: &'static str,
}

impl ClientFloors {
    /// No floors beyond the protocol's own checks: for simulations and tests that study
    /// small rounds, never for a client talking to a coordinator.
    pub fn none() -> Self {
        Self {
            min_parties: 2,
            min_neighbours: 1,
            min_threshold: 1,
            min_noise_multiplier: 0.0,
            require_consistency_check: false,
        }
    }

    /// Checks the floors themselves: finite, non-negative and not below the protocol's
    /// own minimums.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_parties < 2 {
            return Err(format!(
                "min_parties must be at least 2, got {}",
                self.min_parties
            ));
        }
        if self.min_neighbours == 0 || self.min_threshold == 0 {
            return Err("min_neighbours and min_threshold must be at least 1".into());
        }
        if !(self.min_noise_multiplier.is_finite() && self.min_noise_multiplier >= 0.0) {
            return Err(format!(
                "min_noise_multiplier must be a number >= 0, got {}",
                self.min_noise_multiplier
            ));
        }
        Ok(())
    }

    /// Checks a round's settings when the client joins it.
    pub fn check(&self, config: &RoundConfig) -> Result<(), BelowFloor> {
        if self.require_consistency_check && !config.consistency_check {
            return Err(BelowFloor {
                setting: "consistency check",
                found: "off".into(),
                floor: "on".into(),
                flag: "--allow-no-consistency-check",
            });
        }
        if config.parties < self.min_parties {
            return Err(BelowFloor {
                setting: "party count",
                found: config.parties.to_string(),
                floor: self.min_parties.to_string(),
                flag: "--min-parties",
            });
        }
        let n = config.parties as usize;
        let k = effective_degree(n, config.neighbours);
        // A complete graph cannot have more neighbours; the party floor covers small n.
        let floor = self.min_neighbours.min(n.saturating_sub(1));
        if k < floor {
            return Err(BelowFloor {
                setting: "neighbourhood",
                found: format!("{k} neighbours"),
                floor: floor.to_string(),
                flag: "--min-neighbours",
            });
        }
        if config.threshold < self.min_threshold {
            return Err(BelowFloor {
                setting: "threshold",
                found: config.threshold.to_string(),
                floor: self.min_threshold.to_string(),
                flag: "--min-threshold",
            });
        }
        if self.min_noise_multiplier > 0.0 {
            let z = config
                .quantization
                .distributed_noise
                .map_or(0.0, |n| n.noise_multiplier);
            if z < self.min_noise_multiplier {
                return Err(self.noise_floor(format!("{z}")));
            }
        }
        Ok(())
    }

    /// Checks the survivors (`U3`) the client is asked to unmask: enough inputs in the
    /// sum, and enough noise shares in it for the noise floor. The noise of `m` survivors
    /// of `n` planned is `z * sqrt(m / n)`.
    pub fn check_survivors(
        &self,
        config: &RoundConfig,
        survivors: usize,
    ) -> Result<(), BelowFloor> {
        if survivors < self.min_parties as usize {
            return Err(BelowFloor {
                setting: "number of inputs in the sum",
                found: survivors.to_string(),
                floor: self.min_parties.to_string(),
                flag: "--min-parties",
            });
        }
        if self.min_noise_multiplier > 0.0 {
            let z = config.quantization.distributed_noise.map_or(0.0, |n| {
                n.noise_multiplier * (survivors as f64 / f64::from(config.parties)).sqrt()
            });
            if z < self.min_noise_multiplier {
                return Err(self.noise_floor(format!("{z:.4} with {survivors} survivors")));
            }
        }
        Ok(())
    }

    fn noise_floor(&self, found: String) -> BelowFloor {
        BelowFloor {
            setting: "noise multiplier",
            found,
            floor: self.min_noise_multiplier.to_string(),
            flag: "--min-noise-multiplier",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::privacy::distributed::DistributedNoise;
    use crate::secagg::QuantizationParams;

    fn config(parties: u32, neighbours: usize, threshold: usize, z: Option<f64>) -> RoundConfig {
        RoundConfig {
            session: [1; 32],
            context: Default::default(),
            parties,
            threshold,
            neighbours,
            dimension: 4,
            quantization: QuantizationParams {
                distributed_noise: z.map(|z| DistributedNoise {
                    l2_clip: 1.0,
                    noise_multiplier: z,
                }),
                ..QuantizationParams::default()
            },
            consistency_check: true,
        }
    }

    #[test]
    fn each_setting_below_its_floor_is_refused_by_name() {
        let floors = ClientFloors {
            min_parties: 10,
            min_neighbours: 8,
            min_threshold: 5,
            min_noise_multiplier: 1.0,
            require_consistency_check: true,
        };
        assert_eq!(floors.check(&config(100, 8, 5, Some(1.0))), Ok(()));
        let unchecked = RoundConfig {
            consistency_check: false,
            ..config(100, 8, 5, Some(1.0))
        };
        assert_eq!(
            floors.check(&unchecked).unwrap_err().to_string(),
            "the round's consistency check is off, below this client's floor of on \
             (--allow-no-consistency-check)"
        );
        let allowing = ClientFloors {
            require_consistency_check: false,
            ..floors
        };
        assert_eq!(allowing.check(&unchecked), Ok(()));
        let flag = |c: RoundConfig| floors.check(&c).unwrap_err().flag;
        assert_eq!(flag(config(9, 8, 5, Some(1.0))), "--min-parties");
        assert_eq!(flag(config(100, 6, 4, Some(1.0))), "--min-neighbours");
        assert_eq!(flag(config(100, 8, 4, Some(1.0))), "--min-threshold");
        assert_eq!(flag(config(100, 8, 5, Some(0.9))), "--min-noise-multiplier");
        assert_eq!(flag(config(100, 8, 5, None)), "--min-noise-multiplier");
        assert_eq!(flag(config(100, 8, 5, Some(0.0))), "--min-noise-multiplier");
        let message = floors
            .check(&config(100, 8, 1, Some(1.0)))
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            "the round's threshold is 1, below this client's floor of 5 (--min-threshold)"
        );
    }

    #[test]
    fn a_complete_graph_meets_a_neighbour_floor_larger_than_the_round() {
        let floors = ClientFloors {
            min_neighbours: 20,
            ..ClientFloors::default()
        };
        // 6 clients, complete graph: 5 neighbours each, all there are.
        assert_eq!(floors.check(&config(6, 5, 3, None)), Ok(()));
        assert!(floors.check(&config(60, 10, 6, None)).is_err());
    }

    #[test]
    fn survivors_must_be_enough_inputs_and_carry_enough_noise() {
        let floors = ClientFloors {
            min_parties: 3,
            min_noise_multiplier: 0.5,
            ..ClientFloors::default()
        };
        let c = config(100, 10, 6, Some(1.0));
        assert_eq!(floors.check_survivors(&c, 100), Ok(()));
        assert_eq!(floors.check_survivors(&c, 25), Ok(()), "z sqrt(1/4) = 0.5");
        assert_eq!(
            floors.check_survivors(&c, 24).unwrap_err().flag,
            "--min-noise-multiplier"
        );
        assert_eq!(
            ClientFloors::default()
                .check_survivors(&c, 2)
                .unwrap_err()
                .flag,
            "--min-parties"
        );
    }

    #[test]
    fn floors_themselves_are_checked() {
        assert!(ClientFloors::default().validate().is_ok());
        assert!(ClientFloors::none().validate().is_ok());
        for bad in [
            ClientFloors {
                min_parties: 1,
                ..ClientFloors::default()
            },
            ClientFloors {
                min_threshold: 0,
                ..ClientFloors::default()
            },
            ClientFloors {
                min_noise_multiplier: f64::NAN,
                ..ClientFloors::default()
            },
            ClientFloors {
                min_noise_multiplier: -1.0,
                ..ClientFloors::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
