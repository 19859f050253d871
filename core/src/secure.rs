//! An experiment's secure aggregation (SecAgg+) settings, and the public settings of
//! one round sized from them for its real number of clients.

use cohort_aggregation::secagg::{
    self, QuantizationParams, RoundConfig, RoundContext, effective_degree, sizing,
};
use serde::{Deserialize, Serialize};

/// An experiment's secure aggregation settings (`"secure_aggregation": {...}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct SecureAggregationSpec {
    /// Shares needed to rebuild a client's secrets (`t`); more than half the
    /// neighbours. Default: the smallest that keeps updates private against the
    /// colluding fraction (just over half without colluding clients). One set too low for
    /// a round's real number of clients is raised for that round, never lowered.
    pub threshold: Option<usize>,
    /// Neighbours per client (`k`). Default: `O(log n)` for the `n` clients selected per
    /// round, sized so that 10% dropout fails a round with probability at most 10^-3
    /// (20 for 100 clients, the complete graph for 10); `n - 1` or more is the complete
    /// graph.
    pub neighbours: Option<usize>,
    /// The fraction of selected clients assumed to collude with a coordinator that
    /// cheats (Sybil enrolments included), in `[0, 0.5)`. Unset neighbours and thresholds
    /// are sized so that no client's update is exposed except with probability `2^-40` a
    /// round (Bell et al. 2020's bound). Default 0: every enrolled client is an honest
    /// site (checked out of band by its identity fingerprint).
    pub colluding_fraction: f64,
    /// Each update coordinate is clipped to `[-clip, clip]` before quantisation.
    pub clip: f32,
    /// Sample counts above this count as this in the weighted mean.
    pub max_weight: u32,
    /// Whether survivors sign the survivor list and reveal their shares only after
    /// seeing `threshold` of their neighbours' signatures over the same list (one more
    /// round trip). On by default: without it a coordinator that cheats can tell
    /// neighbours different survivor lists and unmask a single client's update.
    pub consistency_check: bool,
    /// Seconds selected clients have to advertise their keys.
    pub advertise_seconds: u64,
    /// Seconds clients have to reveal their graph nonces once advertising closed.
    pub reveal_seconds: u64,
    /// Seconds clients have to send their encrypted shares.
    pub share_seconds: u64,
    /// Seconds survivors have to sign the survivor list (consistency check).
    pub confirm_seconds: u64,
    /// Seconds survivors have to reveal their shares.
    pub unmask_seconds: u64,
}

impl Default for SecureAggregationSpec {
    fn default() -> Self {
        let q = QuantizationParams::default();
        Self {
            threshold: None,
            neighbours: None,
            colluding_fraction: 0.0,
            clip: q.clip,
            max_weight: q.max_weight,
            consistency_check: true,
            advertise_seconds: 30,
            reveal_seconds: 30,
            share_seconds: 30,
            confirm_seconds: 30,
            unmask_seconds: 30,
        }
    }
}

impl SecureAggregationSpec {
    /// `k` and `t` for a round of `parties` selected clients (the real count, which
    /// Poisson sampling for differential privacy makes vary from round to round). Unset
    /// ones are sized for [`secagg::DESIGN_DROPOUT`] and the colluding fraction
    /// ([`sizing::size`]); a threshold set too low for this many parties is raised to the
    /// smallest safe one (never lowered). `Err` says why no threshold works: the round
    /// must not open.
    pub fn settings_for(&self, parties: usize) -> Result<(usize, usize), String> {
        // An unset k is sized once, with its threshold; a set k gets the smallest safe
        // threshold for it.
        let (k, sized_t) = match self.neighbours {
            Some(k) => (k, None),
            None => {
                let s = sizing::size(parties, secagg::DESIGN_DROPOUT, self.colluding_fraction)
                    .map_err(|e| e.to_string())?;
                (s.neighbours, Some(s.threshold))
            }
        };
        let floor = sizing::min_threshold(parties, k, self.colluding_fraction);
        let t = self
            .threshold
            .map_or(sized_t.unwrap_or(floor), |t| t.max(floor));
        let keff = effective_degree(parties, k);
        if t > keff {
            return Err(format!(
                "with {parties} clients and {keff} neighbours each, no threshold keeps updates \
                 private against a colluding fraction of {} (it would need {t} > {keff} \
                 shares); raise neighbours or lower threshold",
                self.colluding_fraction
            ));
        }
        Ok((k, t))
    }

    /// Fewest available clients a round can start with: `t + 1` for the round of
    /// `wanted` clients, so that every client has `t` neighbours.
    pub fn min_clients(&self, wanted: usize) -> usize {
        self.settings_for(wanted).map_or(wanted, |(_, t)| t + 1)
    }

    /// The public settings of a round of `parties` selected clients, checked as the
    /// clients will check them: `Err` (the round must not open, nor be charged to a
    /// privacy budget) when no valid setting exists for this many parties.
    pub fn round_config(
        &self,
        parties: usize,
        dimension: usize,
        session: [u8; 32],
        context: RoundContext,
    ) -> Result<RoundConfig, String> {
        let (neighbours, threshold) = self.settings_for(parties)?;
        let config = RoundConfig {
            session,
            context,
            consistency_check: self.consistency_check,
            parties: parties as u32,
            threshold,
            neighbours,
            dimension,
            quantization: QuantizationParams {
                clip: self.clip,
                max_weight: self.max_weight,
                ..QuantizationParams::default()
            },
        };
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }

    /// Checks the settings for rounds of up to `wanted` clients and `dimension`
    /// parameters; the message names the field.
    pub fn validate(&self, wanted: usize, dimension: usize) -> Result<(), String> {
        for (name, secs) in [
            ("advertise_seconds", self.advertise_seconds),
            ("reveal_seconds", self.reveal_seconds),
            ("share_seconds", self.share_seconds),
            ("confirm_seconds", self.confirm_seconds),
            ("unmask_seconds", self.unmask_seconds),
        ] {
            if secs == 0 || secs > 86_400 {
                return Err(format!("{name} must be between 1 and 86400, got {secs}"));
            }
        }
        if wanted < 3 {
            return Err(format!(
                "secure aggregation needs at least 3 clients per round, got {wanted}"
            ));
        }
        if self.neighbours == Some(0) {
            return Err("neighbours must be at least 1".into());
        }
        if !(self.colluding_fraction.is_finite() && (0.0..0.5).contains(&self.colluding_fraction)) {
            return Err(format!(
                "colluding_fraction must be in [0, 0.5), got {}",
                self.colluding_fraction
            ));
        }
        if let (Some(t), Some(k)) = (self.threshold, self.neighbours) {
            let keff = effective_degree(wanted, k);
            if 2 * t <= keff || t > keff {
                return Err(format!(
                    "threshold must be more than half of the {keff} neighbours and at most \
                     {keff} (between {} and {keff}), got {t}",
                    keff / 2 + 1
                ));
            }
        }
        self.round_config(wanted, dimension, [0; 32], RoundContext::default())
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Finding 6 of the security review: `k` and `t` came from the planned number of
    /// clients, so a Poisson draw of 11 for 10 planned gave `t = 5` of 10 neighbours (not
    /// more than half): a round no client would take, stuck in advertising and already
    /// charged. Now every count a draw can give gets settings the clients accept.
    #[test]
    fn every_party_count_a_poisson_draw_can_give_gets_valid_settings() {
        let spec = SecureAggregationSpec::default();
        for parties in 3..=300 {
            let config = spec
                .round_config(parties, 8, [0; 32], RoundContext::default())
                .unwrap_or_else(|e| panic!("{parties} parties: {e}"));
            config.validate().unwrap();
            let floors = secagg::ClientFloors::default();
            floors.check(&config).unwrap();
        }
    }

    #[test]
    fn a_threshold_set_too_low_for_the_draw_is_raised_and_one_that_cannot_fit_refuses() {
        let spec = SecureAggregationSpec {
            neighbours: Some(4),
            threshold: Some(3),
            ..SecureAggregationSpec::default()
        };
        // Three clients: two neighbours each, a threshold of 3 cannot be met.
        assert!(
            spec.round_config(3, 8, [0; 32], RoundContext::default())
                .is_err()
        );
        for parties in 4..=40 {
            let c = spec
                .round_config(parties, 8, [0; 32], RoundContext::default())
                .unwrap();
            assert!(c.threshold >= 3 && c.validate().is_ok(), "{parties}");
        }
        // The complete graph of 9 (k = 8) needs 5: the 3 asked for is raised, not kept.
        let complete = SecureAggregationSpec {
            neighbours: Some(20),
            threshold: Some(3),
            ..SecureAggregationSpec::default()
        };
        assert_eq!(
            complete
                .round_config(9, 8, [0; 32], RoundContext::default())
                .unwrap()
                .threshold,
            5
        );
    }

    #[test]
    fn colluding_clients_size_the_default_neighbourhood() {
        let honest = SecureAggregationSpec::default().settings_for(1000).unwrap();
        let wary = SecureAggregationSpec {
            colluding_fraction: 0.05,
            ..SecureAggregationSpec::default()
        }
        .settings_for(1000)
        .unwrap();
        assert!(
            wary.0 > honest.0 && wary.1 > honest.1,
            "{honest:?} {wary:?}"
        );
        let too_many = SecureAggregationSpec {
            colluding_fraction: 0.5,
            ..SecureAggregationSpec::default()
        };
        assert!(too_many.validate(100, 8).is_err());
    }
}
